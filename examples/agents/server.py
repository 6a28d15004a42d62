"""The example SQL agent (sql_agent.py) served as an agent server: the rollout service's agent lane
starts each attempt with POST /run, lending the attempt an OpenAI-compatible `base_url` of its own.

    python examples/agents/server.py --refenv http://127.0.0.1:8090 --listen 127.0.0.1:8095

Then the service takes it as an env: `rollout-service serve --env http://127.0.0.1:8095 ...`.

    GET  /health              refenv's health, as an agent server's: capabilities.drive_modes ["agent"],
                              workers and pool = refenv's pool (one world per run)
    GET  /tasks               refenv's tasks
    POST /run                 one episode: {attempt_id, task_id | slug, base_url, api_key, model, sampling,
                              limits: {max_turns, max_tokens_total, timeout_s}, reward_profile}
                              -> the final form {attempt_id, task_id, slug, done, status, answer?, pass?,
                              reward?, score}
    DELETE /run/{attempt_id}  stops the run and gives its world back (410: no such run)

The contract: docs/agents.md; this example from end to end: docs/agent-example.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from sql_agent import EnvironmentFailure, Episode, Limits, RefenvTools, ToolError, UnknownTask, solve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from refenv.episodes import ContractError
from refenv.server import ERROR_HANDLERS, read_json
from rollout_service.flags import parse_listen
from rollout_service.listening import ReportingServer

DEFAULT_TIMEOUT_S = 600.0


class RunLimits(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_turns: int = Field(8, ge=1, le=1024)
    max_tokens_total: int | None = Field(None, ge=1)
    timeout_s: float | None = Field(None, gt=0)


class RunBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    attempt_id: str = Field(min_length=1, max_length=256)
    task_id: str | None = None
    slug: str | None = None
    base_url: str = Field(min_length=1)
    api_key: str = ""
    model: str = Field(min_length=1)
    sampling: dict[str, Any] = {}
    limits: RunLimits = RunLimits()
    reward_profile: str | None = None


@dataclass
class Counters:
    """Each run ends one way: started == finished + failed + abandoned + timed_out + live runs."""

    started: int = 0
    finished: int = 0
    failed: int = 0
    abandoned: int = 0
    timed_out: int = 0


@dataclass
class Run:
    body: RunBody
    episode: Episode = field(default_factory=Episode)
    task: asyncio.Task | None = None
    stopped: bool = False  # by DELETE, which counts it


class AgentServer:
    def __init__(self, refenv_url: str, refenv_token: str | None) -> None:
        self.refenv = RefenvTools(refenv_url, refenv_token)
        self.runs: dict[str, Run] = {}
        self.counters = Counters()

    async def refenv_json(self, path: str) -> dict:
        try:
            answer = await self.refenv.get(path)
        except EnvironmentFailure as exc:
            raise ContractError(503, "env_unavailable", str(exc)) from None
        if answer.status_code != 200:
            raise ContractError(503, "env_unavailable", f"refenv {path}: HTTP {answer.status_code}")
        return answer.json()

    async def health(self) -> dict:
        env = await self.refenv_json("/health")
        pool = env.get("capabilities", {}).get("pool") or env.get("workers", 1)
        keep = ("tasks", "dataset", "reward_version", "reward_profile", "suite")
        c = self.counters
        return {
            "status": "ready" if env.get("status") == "ready" else env.get("status", "unavailable"),
            "workers": pool,  # one refenv world per run: more runs at once would only wait for one
            **{k: env[k] for k in keep if k in env},
            "capabilities": {"drive_modes": ["agent"], "pool": pool, "tools": ["list_tables", "run_sql", "submit"]},
            "runs": {
                "live": len(self.runs),
                "started": c.started,
                "finished": c.finished,
                "failed": c.failed,
                "abandoned": c.abandoned,
                "timed_out": c.timed_out,
            },
        }

    async def run(self, request: Request, body: RunBody) -> dict:
        if body.attempt_id in self.runs:
            raise ContractError(409, "attempt_running", f"attempt {body.attempt_id!r} is running already")
        run = Run(body)
        run.task = asyncio.create_task(self._episode(run), name=body.attempt_id)
        self.runs[body.attempt_id] = run
        self.counters.started += 1
        try:
            while True:
                done, _ = await asyncio.wait([run.task], timeout=0.5)
                if done:
                    break
                if await request.is_disconnected():  # its caller left: nobody would read the grade
                    run.stopped = True
                    run.task.cancel()
                    await asyncio.wait([run.task])
                    self.counters.abandoned += 1
                    raise ContractError(503, "run_cancelled", "the run's caller left")
        finally:
            self.runs.pop(body.attempt_id, None)
        head = {"attempt_id": body.attempt_id, "task_id": body.task_id, "slug": body.slug}
        if run.task.cancelled():  # stopped by DELETE /run/{attempt_id}, which counted it
            return {**head, "done": True, "status": "abandoned"}
        try:
            final = run.task.result()
        except TimeoutError:
            self.counters.timed_out += 1
            took = f"the run took longer than {body.limits.timeout_s:g}s"
            raise ContractError(504, "episode_timeout", took) from None
        except UnknownTask as exc:
            self.counters.failed += 1
            raise ContractError(404, "unknown_task", str(exc)) from None
        except ToolError as exc:
            self.counters.failed += 1
            raise ContractError(400, "invalid_body", str(exc)) from None
        except Exception as exc:
            self.counters.failed += 1
            raise ContractError(500, "episode_failed", f"{type(exc).__name__}: {exc}") from None
        if final.get("score", {}).get("failure_category"):
            self.counters.failed += 1
        else:
            self.counters.finished += 1
        return {**head, **{k: v for k, v in final.items() if v is not None}}

    async def _episode(self, run: Run) -> dict:
        body = run.body
        timeout = body.limits.timeout_s or DEFAULT_TIMEOUT_S
        client = openai.AsyncOpenAI(
            base_url=body.base_url, api_key=body.api_key or "none", max_retries=0, timeout=timeout
        )
        try:
            async with asyncio.timeout(body.limits.timeout_s):
                return await solve(
                    client,
                    body.model,
                    self.refenv,
                    task_id=body.task_id,
                    slug=body.slug,
                    sampling=body.sampling,
                    limits=Limits(body.limits.max_turns, body.limits.max_tokens_total),
                    reward_profile=body.reward_profile,
                    episode=run.episode,
                )
        finally:
            await client.close()

    async def stop(self, attempt_id: str) -> dict:
        run = self.runs.get(attempt_id)
        if run is None or run.task is None or run.task.done() or run.stopped:
            raise ContractError(410, "run_gone", f"no run {attempt_id!r} is going on")
        run.stopped = True
        run.task.cancel()
        await asyncio.wait([run.task])  # its world is given back before this answers
        self.counters.abandoned += 1
        return {"attempt_id": attempt_id, "done": True, "status": "abandoned"}

    async def shutdown(self) -> None:
        for run in list(self.runs.values()):
            if run.task is not None:
                run.task.cancel()
                await asyncio.wait([run.task])
        await self.refenv.aclose()


def create_app(refenv_url: str, refenv_token: str | None = None) -> Starlette:
    agent = AgentServer(refenv_url, refenv_token)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(await agent.health())

    async def tasks(request: Request) -> JSONResponse:
        return JSONResponse(await agent.refenv_json("/tasks"))

    async def run(request: Request) -> JSONResponse:
        return JSONResponse(await agent.run(request, await read_json(request, RunBody)))

    async def stop(request: Request) -> JSONResponse:
        return JSONResponse(await agent.stop(request.path_params["attempt_id"]))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        try:
            yield
        finally:
            await agent.shutdown()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/tasks", tasks, methods=["GET"]),
            Route("/run", run, methods=["POST"]),
            Route("/run/{attempt_id}", stop, methods=["DELETE"]),
        ],
        exception_handlers=ERROR_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.agent = agent
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refenv", required=True, help="refenv's URL (any mode: the tool routes are always on)")
    parser.add_argument("--refenv-token", help="refenv's --token, if it has one (or REFENV_TOKEN)")
    parser.add_argument("--listen", default="127.0.0.1:8095", help="HOST:PORT; port 0: one the system picks")
    parser.add_argument("--port-file", type=Path, help="write the port bound here once listening")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    token = args.refenv_token or os.environ.get("REFENV_TOKEN") or None
    host, port = parse_listen(args.listen)
    config = uvicorn.Config(
        create_app(args.refenv, token), host=host, port=port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    server = ReportingServer(config, args.port_file)
    print(f"sql agent server: refenv {args.refenv}, listening on http://{args.listen}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
