"""The agent run of one episode: the stages, the actions, and what each turn shows the model.

The run never calls a model itself: it calls an `Ask` function. In step mode that function
parks the observation for the driver; in hosted mode (and for a support-served stage) it
calls an OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from refenv.grading import EpisodeRecord
from refenv.tasks import Task
from refenv.text import loads_clean
from refenv.world import SCHEMA_DESCRIPTION, QueryError, World

ACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": ["sql", "answer"]},
        "input": {"type": "string"},
    },
    "required": ["action", "input"],
    "additionalProperties": False,
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
MAX_ROWS_SHOWN = 20
MAX_CELL_CHARS = 200
MAX_OBSERVATION_CHARS = 2000

SYSTEM_PROMPT = f"""You are a data agent working on a shop's SQLite database.
{SCHEMA_DESCRIPTION}

Reply with exactly one JSON object per turn. When you know the answer (a number, a value,
or names separated by commas):
{{"action": "answer", "input": "..."}}
To run one SQL statement and see its result:
{{"action": "sql", "input": "SELECT COUNT(*) FROM products WHERE category = 'books'"}}
For tasks that ask you to change data, run the UPDATE, then answer "done".
Run a query first unless the question itself holds the answer."""
# The learning suite's one-turn tasks: short, so that a small model's few tokens go to the answer.
PLAIN_SYSTEM_PROMPT = "Answer the question with just the value it asks for."


@dataclass
class Reply:
    """A model's completion and the token counts the driver reported for it."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


Ask = Callable[[dict], Awaitable[Reply]]


class InjectedFault(Exception):
    """Fault injection (`--fail-rate`): the episode fails the way GraphJin's do."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def parse_action(text: str) -> tuple[str, str] | None:
    """(action, input) from a completion, or None when it is not a valid action."""
    try:
        obj = loads_clean(text)  # an escaped lone surrogate would fail SQLite, or the answer's echo
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    action, value = obj.get("action"), obj.get("input")
    if action not in ("sql", "answer") or not isinstance(value, str):
        return None
    return action, value


def _render_result(columns: list[str], rows: list[tuple], truncated: bool, changed: int) -> str:
    if not columns:
        return f"OK, {changed} row(s) changed."
    lines = [" | ".join(columns)] + [" | ".join(_cell(v) for v in row) for row in rows]
    text = "\n".join(lines)
    if truncated:
        text += f"\n(only the first {MAX_ROWS_SHOWN} rows are shown)"
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + "\n(output truncated)"
    return text


def _cell(value: object) -> str:
    # Each value is cut on its own: one long value must not push the other rows out of the observation.
    text = str(value)
    return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS] + "..."


@dataclass
class AgentOptions:
    latency_s: float = 0.0
    responder: bool = False
    fault: str | None = None
    fault_turn: int = 1


async def run_agent(
    task: Task, world: World, ask: Ask, ask_responder: Ask, record: EpisodeRecord, opts: AgentOptions
) -> None:
    """Drive one episode to its end, filling `record`. Raises InjectedFault when told to."""

    async def call(stage: str, messages: list[dict], response_format: dict | None, asker: Ask) -> Reply:
        observation: dict = {"stage": stage, "messages": [dict(m) for m in messages]}
        if response_format is not None:
            observation["response_format"] = response_format
        reply = await asker(observation)
        record.llm_calls += 1
        record.prompt_tokens += max(0, reply.prompt_tokens)
        record.completion_tokens += max(0, reply.completion_tokens)
        return reply

    if task.plain_answer:
        messages = [{"role": "system", "content": PLAIN_SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]
        reply = await call("executor", messages, None, ask)
        record.actor_turns += 1
        record.answer = reply.text.strip() or None
        if opts.fault:
            raise InjectedFault(opts.fault)
        return
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]
    for turn in range(1, task.turn_budget + 1):
        reply = await call("executor", messages, _response_format("action", ACTION_SCHEMA), ask)
        record.actor_turns += 1
        if opts.latency_s:
            await asyncio.sleep(opts.latency_s)  # the action "executing", whatever it is
        if opts.fault and turn >= opts.fault_turn:
            raise InjectedFault(opts.fault)
        messages.append({"role": "assistant", "content": reply.text})
        action = parse_action(reply.text)
        if action is None:
            record.malformed_actions += 1
            messages.append(
                {
                    "role": "user",
                    "content": 'That was not a valid action. Reply with {"action": "sql"|"answer", "input": "..."}.',
                }
            )
            continue
        kind, value = action
        if kind == "answer":
            record.answer = value
            break
        observation_text, _ = await execute_sql(world, value, record)
        messages.append({"role": "user", "content": f"Result:\n{observation_text}"})
    else:
        record.finalized = True
        messages.append({"role": "user", "content": "You are out of turns. Give your final answer now."})
        reply = await call("finalize", messages, _response_format("answer", ANSWER_SCHEMA), ask)
        try:
            obj = loads_clean(reply.text)
            record.answer = obj.get("answer") if isinstance(obj, dict) and isinstance(obj.get("answer"), str) else None
        except (json.JSONDecodeError, RecursionError):
            record.answer = None
        if record.answer is None:
            record.malformed_actions += 1

    if opts.fault:  # the episode answered before its fault's turn: it fails at grading instead
        raise InjectedFault(opts.fault)
    if opts.responder and record.answer is not None:
        await call(
            "responder",
            [
                {"role": "system", "content": "Phrase the answer below for the user in one short sentence."},
                {"role": "user", "content": f"Question: {task.prompt}\nAnswer: {record.answer}"},
            ],
            None,
            ask_responder,
        )


async def execute_sql(world: World, sql: str, record: EpisodeRecord) -> tuple[str, bool]:
    """Run the model's statement off the event loop: (what the model is shown, whether it ran); the text
    is `Error: ...` when it failed or ran out of budget. Step mode's actions and tool mode's run_sql both."""
    try:
        result = await world.in_thread(world.execute, sql, MAX_ROWS_SHOWN, MAX_CELL_CHARS)
    except QueryError as exc:
        return f"Error: {exc}", False
    record.queries_ok += 1
    if result.changed_rows or not result.columns:
        record.writes_attempted += 1
    return _render_result(result.columns, result.rows, result.truncated, result.changed_rows), True
