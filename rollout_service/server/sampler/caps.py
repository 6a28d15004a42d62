"""How much of the service sampler streams may hold: a stream nobody pulls holds its buffer (queue
places, memory, run-log lines) until it expires, so without caps streams could fill the service."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ...sampler_protocol import StreamCreate
from ..errors import Invalid, TooBusy


class OpenStream(Protocol):
    """What the caps read of an open stream."""

    caller: str  # the key it was opened with
    body: StreamCreate

    def expires_in(self, now: float) -> float: ...


@dataclass(frozen=True)
class StreamCaps:
    """--max-sampler-streams, --max-sampler-streams-per-key, --max-sampler-buffer."""

    streams: int
    per_key: int
    buffer: int

    def check(self, open_: list[OpenStream], body: StreamCreate, caller: str) -> None:
        """TooBusy naming the cap a new stream of `body` for `caller` would pass, and when to retry."""
        if body.buffer > self.buffer:  # never fits, however long one waits
            raise Invalid(
                "buffer_over_cap",
                f"buffer={body.buffer} is more than all sampler streams together may hold on this service "
                f"({self.buffer} groups, --max-sampler-buffer): ask for at most that",
            )
        mine = [s for s in open_ if s.caller == caller]
        buffered = sum(s.body.buffer for s in open_)
        if len(open_) >= self.streams:
            error, why, flag, cap = (
                "too_many_streams",
                f"{len(open_)} sampler streams are open",
                "--max-sampler-streams",
                self.streams,
            )
            wait = _seconds_until_room(open_, lambda _: 1, 1)
        elif len(mine) >= self.per_key:
            error, why = "too_many_streams_for_key", f"{len(mine)} streams opened with this key are open"
            flag, cap = "--max-sampler-streams-per-key", self.per_key
            wait = _seconds_until_room(mine, lambda _: 1, 1)
        elif buffered + body.buffer > self.buffer:
            error = "sampler_buffer_full"
            why = f"the open streams' buffers hold {buffered} groups and this one asks {body.buffer}"
            flag, cap = "--max-sampler-buffer", self.buffer
            wait = _seconds_until_room(open_, lambda s: s.body.buffer, buffered + body.buffer - self.buffer)
        else:
            return
        raise TooBusy(
            error,
            f"{why}: this service's cap is {cap} ({flag}). Delete a stream you no longer pull "
            f"(DELETE /samplers/{{id}}), or retry in {wait}s, when enough of them will have expired unpulled",
            retry_after_s=wait,
        )


def _seconds_until_room(streams: list[OpenStream], frees: Callable[[OpenStream], int], room: int) -> int:
    """Whole seconds (at least 1) until `streams`, expiring unpulled soonest first (a stream being pulled:
    its whole idle timeout from now), have freed `room`, each freeing `frees(stream)`."""
    now, freed, left = time.monotonic(), 0, 1.0
    for stream in sorted(streams, key=lambda s: s.expires_in(now)):
        freed, left = freed + frees(stream), stream.expires_in(now)
        if freed >= room:
            break
    return max(1, math.ceil(left))
