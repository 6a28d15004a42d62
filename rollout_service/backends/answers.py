"""What a model server answers, read: completions (ids, logprobs, text) and /tokenize renders.

With vLLM both kinds of completion give the exact completion token ids and one logprob per
completion token, and the prompt's ids: the server's render of the messages (chat; a server that
does not return ids, another OpenAI-compatible one, yields `None` there), or the ids sent, once the
server's count of them agrees (a token prompt: an answer whose count differs or whose tokens are not
ids is refused).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import StrictInt, TypeAdapter

from .errors import BadInferenceResponse
from .json_body import loads

# Token ids and logprobs come by the thousand per answer: checked in pydantic-core, not element by
# element in Python. Ids must be ints as sent (a float or a string is a server's bug); logprobs
# may be any JSON number.
_TOKEN_IDS = TypeAdapter(list[StrictInt])
_LOGPROBS = TypeAdapter(list[float])


@dataclass
class Choice:
    text: str
    finish_reason: str | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    completion_tokens: int  # the ids' length, else the server's usage count
    stop_reason: str | int | None = None  # vLLM: the stop string or token id that ended it


@dataclass
class Completion:
    endpoint: str
    model: str
    # With a token prompt, the very list the caller sent (not a copy): an exact turn's is its trajectory's,
    # which grows after the turn, so read it before then.
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    choices: list[Choice]
    latency_s: float


_TOKENS_KEY = b'"tokens":['
_MARK = f"rollout-service:{secrets.token_hex(8)}"  # TokenizeAnswer.array
_MARK_JSON = f'"{_MARK}"'.encode()


@dataclass
class TokenizeAnswer:
    """A /tokenize answer's body. A conversation's render is thousands of ids, and a turn mostly needs
    only those after the render it had before: `after` finds them by comparing bytes, never turning
    the known ids into Python objects (a decode, a validation and a list comparison of each)."""

    body: bytes

    def ids(self) -> list[int]:
        try:
            tokens = loads(self.body)["tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInferenceResponse(f"unexpected /tokenize answer: {type(exc).__name__}: {exc}") from None
        try:
            return _TOKEN_IDS.validate_python(tokens)
        except ValueError:
            raise BadInferenceResponse("unexpected /tokenize answer: tokens is not a list of ints") from None

    @cached_property
    def array(self) -> bytes | None:
        """The ids as the JSON array the answer holds (b"[1,2,3]"), where it is a compact array of the
        answer's own "tokens" and as long as its "count" says; else None. JSON writes an int one way
        only, so arrays with equal bytes hold equal ids."""
        body = self.body
        at = body.find(_TOKENS_KEY)
        if at < 0:
            return None
        start = at + len(_TOKENS_KEY) - 1
        close = body.find(b"]", start)  # ints only: the first "]" closes the array
        if close < 0:
            return None
        # The answer with the array taken out must be an object whose "tokens" is where the array was
        # (a mark no server writes: not a 0 or a false it may have had under a second "tokens").
        skeleton = body[:start] + _MARK_JSON + body[close + 1 :]
        try:
            shape = loads(skeleton)
        except ValueError:
            return None
        array = body[start : close + 1]
        length = array.count(b",") + 1 if close > start + 1 else 0
        if not isinstance(shape, dict) or shape.get("tokens") != _MARK:
            return None
        count = shape.get("count")
        if type(count) is not int or count != length:
            return None
        return array

    def after(self, known: bytes) -> list[int] | None:
        """The ids after those of `known` (a JSON array as `array` gives) when this answer's begin with
        them and at least one follows; None where the bytes cannot say so for sure (other ids, another
        shape): `ids()` then reads it in whole."""
        array = self.array
        if array is None or len(known) < 3:  # "[]": nothing known
            return None
        prefix = known[:-1] + b","  # "[1,2,3," : the array up to what follows them
        if not array.startswith(prefix):
            return None
        try:
            rest = _TOKEN_IDS.validate_python(loads(b"[" + array[len(prefix) :]))
        except ValueError:
            return None
        return rest or None  # "[1,2, ]" is not JSON: nothing can follow a comma


def structured_output(response_format: Any) -> dict | None:
    """The env's `response_format` as vLLM's `structured_outputs` for /v1/completions."""
    rf = normalize_response_format(response_format)
    if rf is None or rf["type"] == "text":
        return None
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    # Anything but a schema object (a malformed one from the env) constrains to JSON only.
    return {"json": schema} if isinstance(schema, dict) else {"json_object": True}


def normalize_response_format(response_format: Any) -> dict | None:
    """The env's `response_format` as OpenAI's: pass an OpenAI-shaped one through, wrap a bare schema."""
    if not response_format:
        return None
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object", "text"):
        return response_format
    if isinstance(response_format, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": response_format}}
    return None


_TOKEN_ID_PREFIX = "token_id:"


def _ids_of_tokens(tokens: Any) -> list[int]:
    """The ids of a completion's logprobs tokens as vLLM writes them with `return_tokens_as_token_ids`
    ("token_id:42"). Read as one JSON array in C: a Python loop over a 1024-token turn took ~0.2 ms."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("logprobs.tokens is not a list of strings")
    joined = ",".join(tokens)
    if tokens and f",{joined}".count(f",{_TOKEN_ID_PREFIX}") != len(tokens):  # each one begins so
        raise ValueError('logprobs.tokens are not "token_id:<id>" (the server ignored return_tokens_as_token_ids)')
    # Only the prefix each token begins with goes: one inside a token is left to fail the decode.
    ids = _TOKEN_IDS.validate_python(loads(f"[{f',{joined}'.replace(f',{_TOKEN_ID_PREFIX}', ',')[1:]}]"))
    if len(ids) != len(tokens):
        raise ValueError("logprobs.tokens are not one id each")
    return ids


def parse_completion(
    data: dict, endpoint: str, model: str, latency: float, sent_prompt: list[int] | None = None
) -> Completion:
    """The answer as a Completion; raises ValueError (or a lookup error) on any shape it cannot use.
    With `sent_prompt` (token ids sent), the result holds the very list sent: the server's count of
    the prompt's tokens must be its length, and prompt ids it echoes anyway must be those (an echo
    of the same numbers in another JSON form, 1.0 for 1, passes: the ids kept are the ones sent)."""
    raw_choices = data["choices"]
    if not isinstance(raw_choices, list) or not raw_choices:
        raise ValueError("the answer has no choices")
    usage = data.get("usage") or {}
    choices = []
    for raw in sorted(raw_choices, key=lambda c: c.get("index", 0)):
        logprobs = None
        raw_lp = raw.get("logprobs") or {}
        if raw_lp.get("content") is not None:  # chat: one entry per token
            logprobs = [float(t["logprob"]) for t in raw_lp["content"]]
        elif raw_lp.get("token_logprobs") is not None:  # completions
            logprobs = _LOGPROBS.validate_python(raw_lp["token_logprobs"])
        ids = raw.get("token_ids")
        if ids is not None:
            ids = _TOKEN_IDS.validate_python(ids)
        elif raw_lp.get("tokens") is not None and sent_prompt is not None:
            ids = _ids_of_tokens(raw_lp["tokens"])
        text = raw["message"].get("content") if "message" in raw else raw["text"]
        text = text or ""
        if not isinstance(text, str):
            raise ValueError("message.content is not text")
        if not isinstance(raw.get("finish_reason"), str | None):
            raise ValueError("finish_reason is not text")
        # Without ids (a non-vLLM server), the server's own count is what the env must be told.
        count = len(ids) if ids is not None else int(usage.get("completion_tokens") or 0) // len(raw_choices)
        choices.append(
            Choice(
                text=text,
                finish_reason=raw.get("finish_reason"),
                completion_token_ids=ids,
                logprobs=logprobs,
                completion_tokens=count,
                stop_reason=raw.get("stop_reason"),
            )
        )
    prompt_ids = data.get("prompt_token_ids")
    if prompt_ids is None and raw_choices[0].get("prompt_token_ids") is not None:  # completions: per choice
        prompt_ids = raw_choices[0]["prompt_token_ids"]
    if sent_prompt is not None:
        if prompt_ids is not None and prompt_ids != sent_prompt:
            raise ValueError("the prompt_token_ids echoed are not the prompt sent")
        # What says the server generated from these ids, now that they are not echoed: its own count.
        counted = usage.get("prompt_tokens")
        if counted != len(sent_prompt):
            raise ValueError(f"the server counted {counted} prompt tokens where {len(sent_prompt)} were sent")
        prompt_ids = sent_prompt
    elif prompt_ids is not None:
        prompt_ids = _TOKEN_IDS.validate_python(prompt_ids)
    return Completion(
        endpoint=endpoint,
        model=data.get("model", model),
        prompt_token_ids=prompt_ids,
        prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or ())),
        choices=choices,
        latency_s=latency,
    )
