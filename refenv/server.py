"""refenv's HTTP server: the routes and status codes of GraphJin's `env serve --step`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Coroutine
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from refenv import SUITE_VERSION
from refenv.agent import AgentOptions, Reply, run_agent
from refenv.config import Settings
from refenv.episodes import ContractError, EpisodeTable, SupportModelError
from refenv.grading import PROFILES, REWARD_VERSION, EpisodeRecord, failure_score, grade
from refenv.support import SupportModel
from refenv.tasks import Task
from refenv.text import loads_clean
from refenv.tools import ToolWorlds
from refenv.world import WorldPool, catalog_hash, table_rows

MAX_BODY_BYTES = 1 << 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResetBody(_Body):
    task_id: str | None = None
    slug: str | None = None
    reward_profile: str | None = None


class StepBody(_Body):
    episode_id: str
    completion: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


class EpisodesBody(ResetBody):
    include_trajectory: bool = False


class SqlBody(_Body):
    sql: str


class Usage(_Body):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_calls: int = 0


class SubmitBody(_Body):
    answer: str | None = None
    usage: Usage = Usage()


def _error(status: int, error: str, message: str = "") -> JSONResponse:
    body = {"error": error}
    if message:
        body["message"] = message
    return JSONResponse(body, status_code=status)


async def _contract_error(request: Request, exc: ContractError) -> JSONResponse:
    return _error(exc.status, exc.error, exc.message)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error(exc.status_code, code, str(exc.detail))


# The contract's error bodies for refenv's routes (and the example agent server's, examples/agents/).
ERROR_HANDLERS = {ContractError: _contract_error, HTTPException: _http_error}

_B = TypeVar("_B", bound=BaseModel)


async def read_json(request: Request, model: type[_B]) -> _B:
    """Decode a body as GraphJin does: capped at 1 MiB, empty means defaults, extras ignored; a lone
    surrogate in a string becomes U+FFFD (`clean_text`). Errors are the contract's 400 invalid_body
    (the example agent server, examples/agents/server.py, reads its bodies with it too)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ContractError(400, "invalid_body", "request body exceeds 1 MiB")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        # Cleaned here, before any handler keeps or echoes a string: a completion holding a lone
        # surrogate would otherwise be applied, then fail this answer and every later one (500).
        data = loads_clean(raw) if raw.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise ContractError(400, "invalid_body", f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ContractError(400, "invalid_body", "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ContractError(400, "invalid_body", f"{where}: {first['msg']}") from None


class Environment:
    """Everything one refenv process serves."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        pristine, self.tasks = settings.load()
        self.catalog_hash = catalog_hash(pristine)
        self.pristine_rows = table_rows(pristine)
        self.by_id = {t.task_id: t for t in self.tasks}
        self.by_slug = {t.slug: t for t in self.tasks}
        self.support = SupportModel(settings.support_model) if settings.support_model else None
        self.pool = WorldPool(pristine, settings.pool)
        self.episodes = EpisodeTable(
            self.pool,
            self.pristine_rows,
            step_timeout=settings.step_timeout_s,
            latency_s=settings.latency_ms / 1000,
            fail_rate=settings.fail_rate,
            seed=settings.seed,
            responder=settings.responder,
            support_ask=self.support,
        )
        # Worlds lent to agent programs: the same pool, counters and idle deadline as step episodes.
        self.tools = ToolWorlds(self.pool, self.pristine_rows, self.episodes.counters, settings.step_timeout_s)

    def find_task(self, body: ResetBody) -> Task:
        if body.task_id:
            task = self.by_id.get(body.task_id)
            name = f"task_id {body.task_id!r}"
        elif body.slug:
            task = self.by_slug.get(body.slug)
            name = f"slug {body.slug!r}"
        else:
            return self.tasks[0]
        if task is None:
            raise ContractError(404, "unknown_task", f"no served task has {name}")
        return task

    def profile(self, body: ResetBody) -> str:
        profile = body.reward_profile or self.settings.reward_profile
        if profile not in PROFILES:
            raise ContractError(
                400, "invalid_reward_profile", f"unknown reward profile {profile!r}; known: {', '.join(PROFILES)}"
            )
        return profile

    def health(self) -> dict:
        s, counters = self.settings, self.episodes.counters
        modes = ["episodes", "step", "tools"] if s.step else ["episodes", "tools"]
        capabilities = {"drive_modes": modes, "pool": s.pool}
        if s.split:
            capabilities["split"] = s.split
            capabilities["side"] = s.side or "train"
        return {
            "status": "ready",
            "workers": s.pool,
            "tasks": len(self.tasks),
            "dataset": {"catalog_hash": self.catalog_hash, "data_anchor": SUITE_VERSION},
            "reward_version": REWARD_VERSION,
            "reward_profile": s.reward_profile,
            "suite": {"version": SUITE_VERSION, "seed": s.seed, "scale": s.scale},
            "capabilities": capabilities,
            # Additive, for testing drivers: GraphJin does not report these.
            "leased": self.pool.leased,
            "max_leased": self.pool.max_leased,
            "waiting": self.pool.waiting,
            "max_waiting": self.pool.max_waiting,
            "busy_world_seconds": round(self.pool.busy_world_seconds, 3),
            "live_episodes": self.episodes.live + self.tools.live,
            "tool_worlds": self.tools.live,
            "episodes": {
                "started": counters.started,
                "finished": counters.finished,
                "abandoned": counters.abandoned,
                "reclaimed": counters.reclaimed,
                "failed": counters.failed,
                "timed_out": counters.timed_out,
            },
            "steps": counters.steps,
            "faults": {"latency_ms": s.latency_ms, "fail_rate": s.fail_rate},
        }


class TokenCheck:
    """With --token, every route but /health needs `Authorization: Bearer <token>` (compared in
    constant time): an episode id then drives nothing for whoever does not hold the token."""

    PUBLIC = frozenset({"/health"})

    def __init__(self, app, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.PUBLIC:
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                response = _error(401, "unauthorized", "send Authorization: Bearer <the env's token>")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings) -> Starlette:
    env = Environment(settings)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(env.health())

    async def tasks(request: Request) -> JSONResponse:
        return JSONResponse({"tasks": [t.public() for t in env.tasks], "count": len(env.tasks)})

    async def lease(request: Request, opening: Coroutine[None, None, dict], give_back) -> JSONResponse:
        """The answer of a request that leases a world (a reset, a tool world's open), given back if its
        driver left before learning its id. Waiting for a world has no server-side timeout; only a
        driver that gives up ends it. `give_back(result)` ends what `opening` answered, if it holds a world."""
        answer = asyncio.create_task(opening)
        while True:
            done, _ = await asyncio.wait([answer], timeout=0.5)
            if done:
                result = answer.result()
                if await request.is_disconnected():
                    # The world came as its driver left: nobody would ever learn its id.
                    with contextlib.suppress(ContractError):
                        await give_back(result)
                    raise ContractError(503, "no_world_available", "the request was cancelled")
                return JSONResponse(result)
            if env.pool.leased >= env.pool.size and await request.is_disconnected():
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError, ContractError):
                    result = await answer
                    # It got a world as it was cancelled, but its driver is gone: give the world back.
                    with contextlib.suppress(ContractError):
                        await give_back(result)
                raise ContractError(503, "no_world_available", "the request was cancelled")

    async def reset(request: Request) -> JSONResponse:
        body = await read_json(request, ResetBody)
        task, profile = env.find_task(body), env.profile(body)

        async def give_back(result: dict) -> None:
            if not result.get("done"):
                await env.episodes.abandon(result["episode_id"])

        return await lease(request, env.episodes.reset(task, profile), give_back)

    async def tools_open(request: Request) -> JSONResponse:
        body = await read_json(request, ResetBody)
        task, profile = env.find_task(body), env.profile(body)

        async def give_back(result: dict) -> None:
            await env.tools.abandon(result["world_id"])

        return await lease(request, env.tools.open(task, profile), give_back)

    async def tools_list_tables(request: Request) -> JSONResponse:
        await read_json(request, _Body)
        return JSONResponse(await env.tools.list_tables(request.path_params["world_id"]))

    async def tools_run_sql(request: Request) -> JSONResponse:
        body = await read_json(request, SqlBody)
        return JSONResponse(await env.tools.run_sql(request.path_params["world_id"], body.sql))

    async def tools_submit(request: Request) -> JSONResponse:
        body = await read_json(request, SubmitBody)
        world_id = request.path_params["world_id"]
        return JSONResponse(await env.tools.submit(world_id, body.answer, body.usage.model_dump()))

    async def tools_abandon(request: Request) -> JSONResponse:
        return JSONResponse(await env.tools.abandon(request.path_params["world_id"]))

    async def step(request: Request) -> JSONResponse:
        body = await read_json(request, StepBody)
        return JSONResponse(
            await env.episodes.step(body.episode_id, Reply(body.completion, body.prompt_tokens, body.completion_tokens))
        )

    async def abandon(request: Request) -> JSONResponse:
        return JSONResponse(await env.episodes.abandon(request.path_params["episode_id"]))

    async def episodes(request: Request) -> JSONResponse:
        body = await read_json(request, EpisodesBody)
        if settings.step:
            raise ContractError(
                409,
                "step_mode",
                "this server runs with --step: drive episodes with "
                "POST /step/reset and POST /step (POST /episodes would wait forever)",
            )
        if env.support is None:
            raise ContractError(400, "no_model", "hosted mode needs --support-model URL,NAME")
        return JSONResponse(await _hosted_episode(env, env.find_task(body), env.profile(body), body.include_trajectory))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        reapers = [asyncio.create_task(env.episodes.reap_forever()), asyncio.create_task(env.tools.reap_forever())]
        try:
            yield
        finally:
            for reaper in reapers:
                reaper.cancel()
            await env.episodes.shutdown()
            await env.tools.shutdown()
            if env.support is not None:
                await env.support.aclose()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/tasks", tasks, methods=["GET"]),
            Route("/episodes", episodes, methods=["POST"]),
            Route("/step/reset", reset, methods=["POST"]),
            Route("/step", step, methods=["POST"]),
            Route("/step/{episode_id}", abandon, methods=["DELETE"]),
            Route("/tools/open", tools_open, methods=["POST"]),
            Route("/tools/{world_id}/list_tables", tools_list_tables, methods=["POST"]),
            Route("/tools/{world_id}/run_sql", tools_run_sql, methods=["POST"]),
            Route("/tools/{world_id}/submit", tools_submit, methods=["POST"]),
            Route("/tools/{world_id}", tools_abandon, methods=["DELETE"]),
        ],
        exception_handlers=ERROR_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.env = env
    if settings.token:
        app.add_middleware(TokenCheck, token=settings.token)
    return app


async def _hosted_episode(env: Environment, task: Task, profile: str, include_trajectory: bool) -> dict:
    """POST /episodes without --step: the support model plays every stage."""
    assert env.support is not None
    started = time.monotonic()
    world = await env.pool.acquire()
    trajectory: list[dict] = []

    support = env.support

    async def ask(observation: dict) -> Reply:
        reply = await support(observation)
        trajectory.append({"stage": observation["stage"], "completion": reply.text})
        return reply

    record = EpisodeRecord()
    try:
        try:
            await run_agent(task, world, ask, ask, record, AgentOptions(responder=env.settings.responder))
            score = await world.in_thread(grade, task, world, env.pristine_rows, record, profile)
            status = "completed" if record.answer is not None else "no_answer"
        except SupportModelError as exc:
            score = failure_score(record, "transport_error", str(exc))
            status = "failed"
    finally:
        env.pool.release(world)
    out = {
        "task_id": task.task_id,
        "slug": task.slug,
        "status": status,
        "answer": record.answer,
        "pass": score["pass"],
        "reward": score["vector"]["reward"],
        "score": score,
        "latency_ms": round((time.monotonic() - started) * 1000),
    }
    if include_trajectory:
        out["trajectory"] = trajectory
    return out
