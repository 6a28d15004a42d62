"""How much of the service sampler streams may hold: a stream nobody pulls holds its buffer (queue
places, memory, run-log lines) until it expires, so without caps streams could fill the service."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from ..sampler_protocol import StreamCreate
from .errors import Invalid, TooBusy


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
        need = 1  # streams that must go before it fits
        if len(open_) >= self.streams:
            error, why, holders = "too_many_streams", f"{len(open_)} sampler streams are open", open_
            flag, cap = "--max-sampler-streams", self.streams
        elif len(mine) >= self.per_key:
            error, why, holders = "too_many_streams_for_key", f"{len(mine)} streams opened with this key are open", mine
            flag, cap = "--max-sampler-streams-per-key", self.per_key
        elif buffered + body.buffer > self.buffer:
            error, holders = "sampler_buffer_full", open_
            why = f"the open streams' buffers hold {buffered} groups and this one asks {body.buffer}"
            flag, cap = "--max-sampler-buffer", self.buffer
            need = _streams_to_free(open_, buffered + body.buffer - self.buffer)
        else:
            return
        wait = expiry(holders, need)
        raise TooBusy(
            error,
            f"{why}: this service's cap is {cap} ({flag}). Delete a stream you no longer pull "
            f"(DELETE /samplers/{{id}}), or retry in {wait}s, when the soonest of them expires unpulled",
            retry_after_s=wait,
        )


def _streams_to_free(streams: list[OpenStream], groups: int) -> int:
    """How many of `streams`, in the order they would expire, must go to free `groups` of buffer."""
    now, freed = time.monotonic(), 0
    for count, stream in enumerate(sorted(streams, key=lambda s: s.expires_in(now)), start=1):
        freed += stream.body.buffer
        if freed >= groups:
            return count
    return len(streams)


def expiry(streams: list[OpenStream], count: int = 1) -> int:
    """Whole seconds (at least 1) until `count` of `streams` would have expired if nobody pulls them; a
    stream being pulled counts its whole idle timeout from now."""
    now = time.monotonic()
    left = sorted(s.expires_in(now) for s in streams)
    return max(1, math.ceil(left[min(count, len(left)) - 1] if left else 1.0))
