"""One call on an attempt's model endpoint: one turn of the attempt.

The call's messages are rendered (messages.py) and the turn generated as the step lane generates
one (`AttemptRun._turn`: the attempt's replica, its policy version or pin, token prompts that go on
from its trajectory), then recorded on the attempt and answered in OpenAI's form, the tool calls
read from the sampled text. What the call may ask is the group's: a larger max_tokens, a higher
temperature or top_p, n > 1 are refused (400); a lower temperature or top_p, or stop strings, are
replaced by the group's, and logprobs, penalties, logit_bias, seed are not applied (each recorded in
`attempt.agent.adjusted`), so every turn samples as its group.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...backends.env_client import Observation, StepAnswer
from ...backends.errors import InferenceError
from ...backends.tool_calls import ParsedText, parse_tool_calls
from ...protocol import Turn, describe_errors
from ..groups.failures import Stale, TooManyTurns
from .messages import returned_key, template_messages
from .sessions import AgentRefused, AgentSession


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request the endpoint reads; others are ignored."""

    model_config = ConfigDict(extra="ignore")
    messages: list[Any] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: Any = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    # Sampling the group's does not take: not applied, and said on the attempt (`_UNAPPLIED`).
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None


# The values of those fields that ask for nothing (OpenAI's and vLLM's defaults); any other is recorded.
_UNAPPLIED: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "seed": (),
    "top_k": (0, -1),
    "min_p": (0,),
}


def parse_request(body: bytes) -> ChatRequest:
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise AgentRefused(400, "invalid_json", "the body is not valid JSON") from None
        raise AgentRefused(400, "invalid_request", describe_errors(exc.errors())) from None


def _sampling(session: AgentSession, call: ChatRequest) -> dict[str, Any]:
    """The turn's sampling: the group's, with a smaller max_tokens where asked; AgentRefused for more."""
    group = session.run.group.request.sampling
    asked_tokens = call.max_completion_tokens or call.max_tokens
    over = []
    if call.n is not None and call.n > 1:
        over.append(f"n={call.n} (one choice per turn)")
    if asked_tokens is not None and asked_tokens > group.max_tokens:
        over.append(f"max_tokens={asked_tokens} (the group's is {group.max_tokens})")
    if call.temperature is not None and call.temperature > group.temperature:
        over.append(f"temperature={call.temperature:g} (the group's is {group.temperature:g})")
    if call.top_p is not None and call.top_p > group.top_p:
        over.append(f"top_p={call.top_p:g} (the group's is {group.top_p:g})")
    if over:
        raise session.refuse(400, "over_group_sampling", "asks for more than the group allows: " + "; ".join(over))
    if call.temperature is not None and call.temperature != group.temperature:
        session.adjusted(f"temperature {call.temperature:g} -> {group.temperature:g}")
    if call.top_p is not None and call.top_p != group.top_p:
        session.adjusted(f"top_p {call.top_p:g} -> {group.top_p:g}")
    if call.stop:
        session.adjusted("stop strings: the group's")
    if call.tools and call.tool_choice not in (None, "auto", "none"):  # "required" or a named function
        session.adjusted("tool_choice: not applied (the model chooses whether to call)")
    for name, asks_nothing in _UNAPPLIED.items():
        value = getattr(call, name)
        if value is not None and value not in asks_nothing:
            session.adjusted(f"{name}: not applied (the group's sampling)")
    sampling = group.model_dump()
    sampling["max_tokens"] = asked_tokens or group.max_tokens  # cut to the budget left in the call's turn
    return sampling


async def take_turn(session: AgentSession, call: ChatRequest) -> tuple[Turn, ParsedText]:
    """The call's turn, recorded on the attempt; AgentRefused when it is not served. A call that would
    go past max_turns or the token budget ends the try (max_turns), as a model failure does (its kind)."""
    run, attempt = session.run, session.attempt
    request = run.group.request
    sampling = _sampling(session, call)
    async with session.lock:
        # `failed`, not only `open`: a call queued behind the one that ended the try runs before the
        # lane has closed it, and must not start a turn on an attempt already failed.
        if not session.open or session.failed.done():
            raise AgentRefused(410, "attempt_ended", f"attempt {session.attempt_id} has ended")
        if len(attempt.turns) >= request.max_turns:
            why = f"the agent asked for more than max_turns={request.max_turns} completions"
            session.fail(TooManyTurns(why))
            raise session.refuse(429, "max_turns", why + "; the attempt has ended")
        # What is left now, not when the call came: calls queued behind this lock sample in turn.
        sampling["max_tokens"] = min(sampling["max_tokens"], session.max_tokens_total - session.sampled)
        if sampling["max_tokens"] < 1:
            why = f"the agent's turns sampled its whole token budget (max_tokens_total={session.max_tokens_total})"
            session.fail(TooManyTurns(why))
            raise session.refuse(429, "token_budget", why + "; the attempt has ended")
        stale = run.parts.stale_reason(request, attempt)
        if stale is not None:
            session.fail(Stale(stale))
            raise AgentRefused(410, "attempt_ended", f"the attempt fell behind the policy: {stale}")
        use_tools = bool(call.tools) and call.tool_choice != "none"
        messages = template_messages(call.messages, call.tools if use_tools else None, session.returned)
        stage = min(run.parts.config.policy_stages)
        answer = StepAnswer(
            episode_id=session.attempt_id,
            observation=Observation(stage=stage, messages=messages, response_format=call.response_format),
        )
        try:
            turn = await run._turn(session.t, answer, len(attempt.turns), session.trajectory, sampling)
        except InferenceError as exc:
            session.fail(exc)
            raise AgentRefused(502, exc.kind, f"the model call failed; the attempt has ended: {exc.detail}") from None
        attempt.turns.append(turn)
        session.sampled += turn.completion_tokens
        session.record.calls += 1
        parsed = parse_tool_calls(turn.completion) if use_tools else ParsedText(turn.completion)
        session.record.tool_calls += len(parsed.calls)
        session.record.tool_calls_unparsed += parsed.unparsed
        return turn, parsed


def answer(session: AgentSession, turn: Turn, parsed: ParsedText, model: str) -> dict[str, Any]:
    """The turn as OpenAI's chat completion; the message remembered to be put back as sampled."""
    calls = [(f"call_{uuid.uuid4().hex[:24]}", name, arguments) for name, arguments in parsed.calls]
    session.returned[returned_key(parsed.content, calls)] = turn.completion
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in calls
        ]
    finish = "tool_calls" if parsed.calls else ("length" if turn.finish_reason == "length" else "stop")
    return {
        "id": f"chatcmpl-{session.attempt_id}-{turn.index}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": turn.prompt_tokens,
            "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
        },
    }


def stream_chunks(whole: dict[str, Any]) -> Iterator[bytes]:
    """The answer as server-sent events of `chat.completion.chunk`s: the role, the content, each tool
    call, the finish reason with the usage, then [DONE]. The turn is generated whole first (its tokens
    are recorded before anything is sent), so the chunks come at once."""
    choice = whole["choices"][0]
    message = choice["message"]
    base = {"id": whole["id"], "object": "chat.completion.chunk", "created": whole["created"], "model": whole["model"]}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message["content"]:
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"], usage=whole["usage"])
    yield b"data: [DONE]\n\n"
