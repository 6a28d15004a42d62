"""NDJSON answers whose reader may stop reading (the batch stream, the sampler and its pulls).

Two bounds. A finished group waiting to be sent counts against --max-queued-attempts until its line is
written (`HeldResults`): a reader that does not keep up holds the queue's room, not memory outside
every cap. And a line that cannot be written for --stream-stall-timeout (the reader took nothing
meanwhile: the socket's buffers are full) cuts the answer off (`BoundedStream`): the connection is
closed at once, what was buffered for it dropped, the generator closed, and its `finally` cancels
what it still runs (worlds released; groups that finished are in the run log already).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...listening import abort_connection
from .group_json import group_line

if TYPE_CHECKING:
    from .admission import Admission
    from .group_json import GroupOutcome

log = logging.getLogger("rollout_service.stream")


class HeldResults:
    """Attempts of finished groups that wait for a reader, counted in the service's queued attempts
    (which a group leaves when it finishes) until they are sent or dropped."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.attempts = 0
        self.closed = False

    def hold_when_done(self, task: asyncio.Future, attempts: int) -> None:
        """Count `task`'s attempts again as soon as it finishes with a result (the service's own
        callback, added before this one, has just uncounted them)."""

        def held(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self.hold(attempts)

        task.add_done_callback(held)

    def hold(self, attempts: int) -> None:
        if self.closed:  # finished as its reader went: nothing will wait for it
            return
        self.attempts += attempts
        self.admission.count_held(attempts)

    def release(self, attempts: int) -> None:
        attempts = min(attempts, self.attempts)
        self.attempts -= attempts
        self.admission.count_held(-attempts)

    def close(self) -> None:
        """Nothing more will be sent: release what is held, and hold nothing that finishes later."""
        self.closed = True
        self.release(self.attempts)


class BoundedStream(StreamingResponse):
    """A StreamingResponse that gives up on a reader which takes nothing for `stall_timeout_s`, and
    (given the request) stops its generator as soon as the client goes away, even while no line is
    due. `on_end` runs however it ends."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        stall_timeout_s: float,
        what: str,
        request: Request | None = None,
        on_end: Callable[[], object] | None = None,
        reset_on_stall: bool = True,
    ) -> None:
        super().__init__(content, media_type="application/x-ndjson")
        # A pull counts the lines written before a stall as handed out (only the one being written is
        # told of as undelivered): a reset would drop them unseen, so a pull's connection is closed
        # after what was written, as uvicorn does.
        self.reset_on_stall = reset_on_stall
        self.iterator = content
        self.stall_timeout_s = stall_timeout_s
        self.what = what
        self.request = request
        self.on_end = on_end
        self.stalled = False
        self.client: Iterable[object] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.client = scope.get("client")
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        watcher = asyncio.ensure_future(disconnected(self.request)) if self.request is not None else None
        step: asyncio.Future[bytes] | None = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                step = asyncio.ensure_future(anext(self.iterator))
                await asyncio.wait([step, *([watcher] if watcher else [])], return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the client went away: stop the generator where it waits
                    step.cancel()
                    await asyncio.wait([step])
                    return
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    break
                message = {"type": "http.response.body", "body": chunk, "more_body": True}
                try:
                    await asyncio.wait_for(send(message), self.stall_timeout_s)
                except TimeoutError:
                    self.stalled = True
                    log.warning(
                        "%s: the reader took nothing for %gs (--stream-stall-timeout): cut off, its groups cancelled",
                        self.what,
                        self.stall_timeout_s,
                    )
                    # Closed now, its unsent bytes dropped: the answer is incomplete, the reader sees it end.
                    if self.reset_on_stall:
                        abort_connection(self.client)
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Shielded: Starlette cancels this task when it sees the disconnect first, and a second
            # cancellation must not skip the generator's `finally` (it cancels the groups it still runs
            # and gives back their worlds and queue room) nor `on_end`.
            with anyio.CancelScope(shield=True):
                try:
                    if watcher is not None:
                        watcher.cancel()
                    if step is not None and not step.done():  # cancelled while it waited for the next line
                        step.cancel()
                        await asyncio.wait([step])
                    # Now, not when the generator is collected.
                    await self.iterator.aclose()  # type: ignore[attr-defined]
                finally:
                    if self.on_end is not None:
                        self.on_end()


async def disconnected(request: Request) -> None:
    """Return when the client goes away (after the body is read, receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class BatchLines:
    """POST /groups/batch's answer: each group's line as it finishes, `{index, group}` or `{index,
    error}`; a group is let go here once sent. `abandon` (the answer's `on_end`, and the lines' own
    `finally`) cancels what was not sent (episodes abandoned, worlds released) and gives back the
    queue room held: also when the answer ended before its first line, where the lines never began."""

    def __init__(
        self,
        request: Request,
        admission: Admission,
        tasks: list[asyncio.Task[GroupOutcome]],
        sizes: list[int],
        held: HeldResults,
    ) -> None:
        self.request, self.admission, self.sizes, self.held = request, admission, sizes, held
        self.pending: dict[asyncio.Future, int] = {task: index for index, task in enumerate(tasks)}

    async def lines(self) -> AsyncIterator[bytes]:
        pending, sizes, held = self.pending, self.sizes, self.held
        watcher = asyncio.ensure_future(disconnected(self.request))
        try:
            while pending:
                done, _ = await asyncio.wait([*pending, watcher], return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return  # the trainer went away: the finally below abandons everything
                for task in done:
                    index = pending.pop(task)
                    sent = 0  # attempts held (a finished group) until its line is written
                    if task.cancelled():
                        line = _error_line(index, "cancelled", "the group was cancelled (the service is shutting down)")
                    elif (exc := task.exception()) is not None:
                        line = _error_line(index, "group_failed", f"{type(exc).__name__}: {exc}")
                    else:  # ~1 MB for 8 exact attempts: copied once here
                        line = group_line(b'{"index": %d, "group": ' % index, task.result().body)
                        sent = sizes[index]
                    del task
                    yield line
                    held.release(sent)
        finally:
            watcher.cancel()
            self.abandon()

    def abandon(self) -> None:
        self.held.close()
        # Handed to the admission rather than awaited here: a disconnect cancels every await of the
        # answer's cleanup, which would cut the slicing short.
        unsent, self.pending = self.pending, {}
        self.admission.cancel_in_background({task: self.sizes[index] for task, index in unsent.items()})


def batch_answer(
    request: Request,
    admission: Admission,
    tasks: list[asyncio.Task[GroupOutcome]],
    sizes: list[int],
    held: HeldResults,
    stall_timeout_s: float,
) -> BoundedStream:
    """POST /groups/batch's answer over its started groups (`sizes`: their attempts, held in `held`)."""
    batch = BatchLines(request, admission, tasks, sizes, held)
    del tasks  # from here on the answer holds a group only until its line is sent
    return BoundedStream(batch.lines(), stall_timeout_s, "POST /groups/batch", on_end=batch.abandon)


def _error_line(index: int, error: str, message: str) -> bytes:
    return json.dumps({"index": index, "error": {"error": error, "message": message[:500]}}).encode() + b"\n"
