"""The agent lane: a try whose episode an agent server runs (docs/agents.md).

The service asks the agent server to run the task (`POST /run`) with a base_url and a token of the
try's own; the agent calls the model only there, each call a turn of the attempt (completions.py).
The run's answer is the step contract's final form and grades the attempt as a step episode's does.
Whatever ends the try otherwise is raised for `failures.classify` as in the step lane: the agent
server's errors, garbage, oversized or lost answers are the env's kinds (the agent server is the
env here), the try's deadline is `deadline`, a call past max_turns or the token budget is
`max_turns`, a model failure its own kind. The run is ended (DELETE /run/{id}) by the try's ending
unless it answered (endings.py), and its token revoked before that, on every path.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from ...protocol import Attempt
from ..config import ServiceConfig
from ..groups.attempt import AttemptRun, _Try
from ..groups.outcome import score
from ..membership.targets import EnvHandle
from .sessions import AgentSessions


class AgentLane:
    """Runs tries on agent servers (`groups.attempt.AgentLane`) and holds their sessions."""

    def __init__(self, config: ServiceConfig) -> None:
        self.sessions = AgentSessions()
        self._base = config.agent_base_url.rstrip("/") if config.agent_base_url else None
        self._listen = config.listen

    def listening_on(self, port: int) -> None:
        """The port the service bound (--listen HOST:0): where agents reach it, unless --agent-base-url."""
        host = self._listen.rsplit(":", 1)[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]", "::"):  # every address: this host's loopback is one
            host = "127.0.0.1"
        self._listen = f"{host}:{port}"

    def base_url(self, attempt_id: str) -> str:
        return f"{self._base or 'http://' + self._listen}/agent/{attempt_id}/v1"

    async def episode(self, run: AttemptRun, t: _Try, attempt: Attempt, env: EnvHandle) -> None:
        group, request = run.group, run.group.request
        attempt_id = f"{group.group_id}-a{run.index}-{secrets.token_hex(4)}"
        trajectory = await run._trajectory(t)
        if trajectory is not None:
            attempt.tokens, attempt.trajectory = "exact", trajectory.segments
        budget = request.max_tokens_total or request.max_turns * request.sampling.max_tokens
        left = max(request.timeout_s - (time.monotonic() - t.started), 0.001)
        session = self.sessions.open(attempt_id, run, t, attempt, trajectory, budget, ends_at=time.monotonic() + left)
        attempt.episode_id = attempt_id  # from here the try's ending ends the run (DELETE /run/{id})
        body: dict[str, Any] = {
            "attempt_id": attempt_id,
            "task_id": group.target.task_id,
            "slug": group.target.slug,
            "base_url": self.base_url(attempt_id),
            "api_key": session.token.decode(),
            "model": group.route.model,
            "sampling": request.sampling.model_dump(exclude_none=True),
            "limits": {"max_turns": request.max_turns, "max_tokens_total": budget, "timeout_s": round(left, 3)},
        }
        if request.reward_profile:
            body["reward_profile"] = request.reward_profile
        started, inference_before = time.monotonic(), t.inference
        running = asyncio.ensure_future(env.client.run(body, left + 5.0))  # the try's deadline comes first
        try:
            waits: set[asyncio.Future[Any]] = {running, session.failed}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if session.failed.done():
                raise session.failed.result()
            answer = running.result()
        finally:
            if not running.done():
                running.cancel()
                running.add_done_callback(_retrieve)
            self.sessions.close(session)
            t.env += max(time.monotonic() - started - (t.inference - inference_before), 0.0)
        t.over = True  # the run answered: the agent server has given its world back
        score(attempt, answer)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read: never "exception was never retrieved"
