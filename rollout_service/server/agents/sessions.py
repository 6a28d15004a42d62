"""The attempts an agent server is running, each with the token its model endpoint takes.

A token is made for one try of one attempt (secrets.token_urlsafe) and taken only for that try's
path, only while it runs: another attempt's token is 401, the right token after the try ended is
410. What a try ended with is kept (bounded) so a late call can be told it ended rather than that
its token is wrong.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from ...protocol import AgentRecord, Attempt
from ..groups.attempt import AttemptRun, _Try
from ..groups.trajectory import TrajectoryBuilder

_ENDED_KEPT = 65536  # tries remembered as ended (their token's hash): a late call gets 410, not 401
_REFUSALS_KEPT = 16


class AgentRefused(Exception):
    """A call on the model endpoint that is not served: an HTTP status, a code, and what to change."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(eq=False)
class AgentSession:
    """One try on an agent server, as its model endpoint sees it."""

    attempt_id: str
    token: bytes
    run: AttemptRun
    t: _Try
    attempt: Attempt
    trajectory: TrajectoryBuilder | None
    record: AgentRecord
    max_tokens_total: int
    ends_at: float  # monotonic: the try's deadline
    sampled: int = 0  # completion tokens sampled so far, against max_tokens_total
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one turn at a time: a trajectory grows in order
    # Set when a call ends the try (max_turns, the token budget, a model failure): the lane raises it.
    failed: asyncio.Future[BaseException] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    # The assistant messages returned, by what the agent sends back of them (messages.returned_key):
    # the text as sampled, rendered in their place so the trajectory goes on from the sampled tokens.
    returned: dict[tuple[Any, ...], str] = field(default_factory=dict)
    open: bool = True

    def fail(self, exc: BaseException) -> None:
        """End the try with `exc` (the lane raises it, its failure kind follows); the first one counts."""
        if not self.failed.done():
            self.failed.set_result(exc)

    def refuse(self, status: int, code: str, message: str) -> AgentRefused:
        """A refused call, counted on the attempt."""
        self.record.refused += 1
        if len(self.record.refusals) < _REFUSALS_KEPT:
            self.record.refusals.append(f"{code}: {message}"[:300])
        return AgentRefused(status, code, message)

    def adjusted(self, what: str) -> None:
        if what not in self.record.adjusted:
            self.record.adjusted.append(what)

    def seconds_left(self) -> float:
        return self.ends_at - time.monotonic()

    async def call(self, work: Coroutine[Any, Any, Any]) -> Any:
        """Run a call's work as a task the try's end cancels: a call in flight when the try ends
        answers 410 and its turn is not recorded."""
        if not self.open:
            work.close()
            raise AgentRefused(410, "attempt_ended", f"attempt {self.attempt_id} has ended")
        task = asyncio.ensure_future(work)
        self.calls.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and not self.open:
                raise AgentRefused(410, "attempt_ended", f"attempt {self.attempt_id} ended during this call") from None
            task.cancel()  # the caller went away: its turn goes with it
            raise
        finally:
            self.calls.discard(task)


class AgentSessions:
    """The tries running on agent servers, by attempt id."""

    def __init__(self) -> None:
        self.live: dict[str, AgentSession] = {}
        self._ended: OrderedDict[str, bytes] = OrderedDict()

    def open(
        self,
        attempt_id: str,
        run: AttemptRun,
        t: _Try,
        attempt: Attempt,
        trajectory: TrajectoryBuilder | None,
        max_tokens_total: int,
        ends_at: float,
    ) -> AgentSession:
        record = attempt.agent if attempt.agent is not None else AgentRecord()
        attempt.agent = record
        session = AgentSession(
            attempt_id=attempt_id,
            token=secrets.token_urlsafe(32).encode(),
            run=run,
            t=t,
            attempt=attempt,
            trajectory=trajectory,
            record=record,
            max_tokens_total=max_tokens_total,
            ends_at=ends_at,
        )
        self.live[attempt_id] = session
        return session

    def close(self, session: AgentSession) -> None:
        """The try ended: its token is revoked, its calls in flight cancelled."""
        session.open = False
        self.live.pop(session.attempt_id, None)
        for task in list(session.calls):
            task.cancel()
        self._ended[session.attempt_id] = session.token
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def check(self, attempt_id: str, authorization: str | None) -> AgentSession:
        """The live try `attempt_id` names, if the call carries its token; else AgentRefused (401 for a
        wrong or missing token, whatever the id; 410 for the right token of a try that ended)."""
        scheme, _, given = (authorization or "").partition(" ")
        token = given.strip().encode()
        session = self.live.get(attempt_id)
        known = session.token if session is not None else self._ended.get(attempt_id)
        # Compared whether or not the id is known: the time taken says nothing.
        good = hmac.compare_digest(token, known if known is not None else b"\0" * 43)
        if scheme.lower() != "bearer" or not good or known is None:
            raise AgentRefused(401, "unauthorized", "send Authorization: Bearer <the api_key its run was given>")
        if session is None or not session.open:
            raise AgentRefused(410, "attempt_ended", f"attempt {attempt_id} has ended: its model endpoint is closed")
        return session
