"""How much of the service sampler streams may hold: a stream nobody pulls holds its buffer (queue
places, memory, run-log lines) until it expires, so without caps streams could fill the service."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from ..sampler_protocol import StreamCreate
from .errors import TooBusy


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
        mine = [s for s in open_ if s.caller == caller]
        buffered = sum(s.body.buffer for s in open_)
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
        else:
            return
        wait = soonest_expiry(holders)
        raise TooBusy(
            error,
            f"{why}: this service's cap is {cap} ({flag}). Delete a stream you no longer pull "
            f"(DELETE /samplers/{{id}}), or retry in {wait}s, when the soonest of them expires unpulled",
            retry_after_s=wait,
        )


def soonest_expiry(streams: list[OpenStream]) -> int:
    """Whole seconds (at least 1) until the first of `streams` would expire if nobody pulls it; a stream
    being pulled counts its whole idle timeout from now."""
    now = time.monotonic()
    return max(1, math.ceil(min((s.expires_in(now) for s in streams), default=1.0)))
