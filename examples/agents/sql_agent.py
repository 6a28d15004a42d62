"""A small tool-using SQL agent, written as any agent program is: an `openai` client, a tools list in
OpenAI's format, and its own message history. It works one refenv task in a world refenv lends it
(refenv's tool mode: POST /tools/open, /tools/{id}/list_tables, /run_sql, /submit, DELETE /tools/{id}).

The model it is given may call tools badly (a 135M model rarely calls them at all), so the loop copes:
a reply with no tool call is its final answer and is submitted; a tool's error (bad arguments, an
unknown tool, a failing statement, the task's statement budget) is shown to the model as the tool's
result; `max_turns` and `max_tokens_total` end the loop, and the world is always given back.

    from sql_agent import RefenvTools, solve
    async with RefenvTools("http://127.0.0.1:8090") as refenv:
        final = await solve(AsyncOpenAI(base_url=..., api_key=...), "model", refenv, task_id="t005")

`examples/agents/server.py` serves it as an agent server (docs/agent-example.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_tables",
            "description": "List the database's tables and their columns.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run one SQLite statement and see its result (at most 20 rows).",
            "parameters": {
                "type": "object",
                "properties": {"sql": {"type": "string", "description": "one SQLite statement"}},
                "required": ["sql"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the final answer: a number, a value, or names separated by commas "
            '("done" for a task that changes data). This ends the task.',
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
                "additionalProperties": False,
            },
        },
    },
]

SYSTEM = """You are a data agent working on a shop's SQLite database.
{schema}

Use the tools: run_sql to query the database, then submit with the answer.
For tasks that ask you to change data, run the UPDATE, then submit "done"."""

# What one tool result may put in the history: refenv's own caps keep a result near 2,000 characters.
MAX_TOOL_RESULT_CHARS = 4000
MAX_ANSWER_CHARS = 1000
# What the sampling of a run may name as keyword arguments of `chat.completions.create`; any other
# key goes in `extra_body` (vLLM's own sampling parameters, e.g. top_k).
OPENAI_SAMPLING = frozenset(
    {"temperature", "top_p", "max_tokens", "seed", "stop", "presence_penalty", "frequency_penalty", "logprobs"}
)


class EnvironmentFailure(Exception):
    """refenv could not be reached or answered badly: the episode is unscorable (environment_failure)."""


class ToolError(Exception):
    """A tool call refenv refused (its statement budget, a bad body): shown to the model as the result."""


class UnknownTask(Exception):
    """refenv serves no task by that id or slug (its 404 unknown_task)."""


class WorldGone(Exception):
    """refenv no longer holds the world (reclaimed after its idle deadline, or abandoned)."""


class RefenvTools:
    """refenv's tool mode over HTTP: one client for every world this agent server opens."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Opening waits for a free world with no deadline of refenv's: the run's own timeout bounds it.
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout_s))

    async def __aenter__(self) -> RefenvTools:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def get(self, path: str) -> httpx.Response:
        try:
            return await self.http.get(path)
        except httpx.HTTPError as exc:
            raise EnvironmentFailure(f"refenv GET {path}: {type(exc).__name__}: {exc}") from None

    async def call(self, path: str, body: dict | None = None, *, open_timeout: bool = False) -> dict:
        """POST `body`; the answer's JSON, or the error that fits its status."""
        try:
            answer = await self.http.post(
                path, json=body or {}, timeout=None if open_timeout else httpx.USE_CLIENT_DEFAULT
            )
        except httpx.HTTPError as exc:
            raise EnvironmentFailure(f"refenv {path}: {type(exc).__name__}: {exc}") from None
        try:
            data = answer.json()
        except ValueError:
            raise EnvironmentFailure(f"refenv {path}: HTTP {answer.status_code}, not JSON") from None
        if answer.status_code == 404 and data.get("error") == "unknown_task":
            raise UnknownTask(data.get("message") or "unknown task")
        if answer.status_code == 410:
            raise WorldGone(data.get("message") or "the world is gone")
        if answer.status_code in (400, 409):
            raise ToolError(data.get("message") or data.get("error") or f"HTTP {answer.status_code}")
        if answer.status_code != 200 or not isinstance(data, dict):
            raise EnvironmentFailure(f"refenv {path}: HTTP {answer.status_code}: {str(data)[:300]}")
        return data

    async def open(self, task_id: str | None, slug: str | None = None, reward_profile: str | None = None) -> dict:
        body = {"task_id": task_id, "slug": slug, "reward_profile": reward_profile}
        return await self.call("/tools/open", body, open_timeout=True)

    async def abandon(self, world_id: str) -> None:
        """Give the world back; gone already (410) is as good."""
        try:
            await self.http.delete(f"/tools/{world_id}")
        except httpx.HTTPError:
            pass  # refenv's idle deadline reclaims it


@dataclass
class Limits:
    max_turns: int = 8
    max_tokens_total: int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_calls: int = 0

    def add(self, usage: Any) -> None:
        self.llm_calls += 1
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens or 0
            self.completion_tokens += usage.completion_tokens or 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Episode:
    """One run of the agent: the world it holds and what it has done, kept so a stop can give it back."""

    world_id: str | None = None
    submitted: bool = False
    usage: Usage = field(default_factory=Usage)
    messages: list[dict] = field(default_factory=list)
    tool_errors: int = 0


def unscorable(category: str, detail: str, usage: Usage) -> dict:
    """The final form's `score` of an episode that could not be graded (step contract: unscorable)."""
    return {
        "vector": {"reward": 0.0},
        "pass": False,
        "failure_category": category,
        "failure_detail": detail[:500],
        "tokens": {"prompt": usage.prompt_tokens, "completion": usage.completion_tokens, "total": usage.total},
    }


async def solve(
    model_client: openai.AsyncOpenAI,
    model: str,
    refenv: RefenvTools,
    task_id: str | None = None,
    *,
    slug: str | None = None,
    sampling: dict[str, Any] | None = None,
    limits: Limits | None = None,
    reward_profile: str | None = None,
    episode: Episode | None = None,
) -> dict:
    """Work the task (`task_id` or `slug`) in a world of its own; the final form (refenv's grade, or an
    unscorable one). UnknownTask or ToolError: refenv refused to open that task.

    The world is given back on every path: by submit, or by DELETE when the run fails or is cancelled."""
    episode = episode or Episode()
    limits = limits or Limits()
    try:
        lent = await refenv.open(task_id, slug, reward_profile)
        episode.world_id = lent["world_id"]
        return await _loop(model_client, model, refenv, lent, episode, sampling or {}, limits)
    except (EnvironmentFailure, WorldGone) as exc:
        return {"done": True, "status": "failed", "score": unscorable("environment_failure", str(exc), episode.usage)}
    except (openai.APIConnectionError, openai.APIStatusError) as exc:
        # The model endpoint failed (down, 5xx, or the service ended the attempt: 410): not the policy's doing.
        detail = f"model endpoint: {type(exc).__name__}: {exc}"
        return {"done": True, "status": "failed", "score": unscorable("transport_error", detail, episode.usage)}
    finally:
        if episode.world_id is not None and not episode.submitted:
            await refenv.abandon(episode.world_id)


async def _loop(
    client: openai.AsyncOpenAI,
    model: str,
    refenv: RefenvTools,
    lent: dict,
    episode: Episode,
    sampling: dict[str, Any],
    limits: Limits,
) -> dict:
    world = f"/tools/{lent['world_id']}"
    kwargs = {k: v for k, v in sampling.items() if k in OPENAI_SAMPLING}
    extra = {k: v for k, v in sampling.items() if k not in OPENAI_SAMPLING and k != "n"}
    messages = episode.messages
    messages += [
        {"role": "system", "content": SYSTEM.format(schema=lent["schema"])},
        {"role": "user", "content": lent["prompt"]},
    ]
    answer: str | None = None
    for _ in range(limits.max_turns):
        # The contract's token budget counts the tokens sampled, not the prompts.
        if limits.max_tokens_total is not None and episode.usage.completion_tokens >= limits.max_tokens_total:
            break
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, extra_body=extra or None, **kwargs
        )
        episode.usage.add(reply.usage)
        if not reply.choices:
            break
        message = reply.choices[0].message
        if not message.tool_calls:
            # No tool call: the text is the answer (a small model rarely calls tools at all).
            answer = (message.content or "").strip()[:MAX_ANSWER_CHARS]
            break
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
        messages.append({"role": "assistant", "content": message.content or "", "tool_calls": calls})
        for call in message.tool_calls:
            result, submitted = await _tool(refenv, world, call, episode)
            if submitted is not None:
                return submitted
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result[:MAX_TOOL_RESULT_CHARS]})
    return await _submit(refenv, world, answer, episode)


async def _tool(refenv: RefenvTools, world: str, call: Any, episode: Episode) -> tuple[str, dict | None]:
    """(the result shown to the model, None) or ("", the final form) when the call was a valid submit."""
    name = getattr(call.function, "name", "")
    try:
        args = json.loads(call.function.arguments or "{}")
        if not isinstance(args, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        episode.tool_errors += 1
        return f"Error: the arguments of {name} are not a JSON object ({exc})", None
    try:
        if name == "list_tables":
            return (await refenv.call(f"{world}/list_tables"))["schema"], None
        if name == "run_sql":
            if not isinstance(args.get("sql"), str):
                raise ToolError('run_sql takes {"sql": "<one statement>"}')
            return (await refenv.call(f"{world}/run_sql", {"sql": args["sql"]}))["text"], None
        if name == "submit":
            answer = args.get("answer")
            return "", await _submit(refenv, world, None if answer is None else str(answer), episode)
        raise ToolError(f"there is no tool {name!r}: use list_tables, run_sql or submit")
    except ToolError as exc:
        episode.tool_errors += 1
        return f"Error: {exc}", None


async def _submit(refenv: RefenvTools, world: str, answer: str | None, episode: Episode) -> dict:
    usage = episode.usage
    body = {
        "answer": answer,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "llm_calls": usage.llm_calls,
        },
    }
    final = await refenv.call(f"{world}/submit", body)
    episode.submitted = True
    final.pop("world_id", None)
    final.setdefault("score", {})["tool_errors"] = episode.tool_errors
    return final
