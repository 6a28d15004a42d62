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

import msgspec

from .errors import BadInferenceResponse
from .json_body import dumps, loads
from .transport import HttpAnswer

# Token ids and logprobs come by the thousand per answer: decoded and checked by msgspec in C, not
# element by element in Python. Ids must be ints as sent (strict: a float or a string is a server's
# bug); logprobs may be any JSON number.
_IDS = msgspec.json.Decoder(list[int])


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
            return msgspec.convert(tokens, list[int])
        except msgspec.ValidationError:
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
            rest = _IDS.decode(b"[" + array[len(prefix) :])
        except msgspec.DecodeError:
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
_TOKEN_ID_QUOTED = b'"token_id:'
# The bytes of a string's quotes and prefix: taken out in one pass (bytes.translate), they leave the ids.
_TOKEN_ID_BYTES = bytes(set(_TOKEN_ID_QUOTED))


class _ChatLogprob(msgspec.Struct):
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_ChatLogprob] | None = None  # chat: one entry per token
    token_logprobs: list[float] | None = None  # completions
    # vLLM's "token_id:<id>" per token, kept as the JSON it came as: read into ids without making a
    # string of each (`_ids_of_tokens`).
    tokens: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None | msgspec.UnsetType = msgspec.UNSET
    message: _Message | None | msgspec.UnsetType = msgspec.UNSET
    finish_reason: str | None = None
    stop_reason: Any = None  # vLLM: the stop string or token id that ended it
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    prompt_token_ids: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # completions: per choice


class _Answer(msgspec.Struct):
    """A completion answer as far as the service reads it; everything else in it is skipped unread."""

    choices: list[_Choice]
    model: str | None | msgspec.UnsetType = msgspec.UNSET
    usage: dict[str, Any] | None = None
    prompt_token_ids: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # chat, with return_token_ids


_ANSWER = msgspec.json.Decoder(_Answer)


def _present(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


def _ids_of_tokens(tokens: msgspec.Raw) -> list[int]:
    """The ids of a completion's logprobs tokens as vLLM writes them with `return_tokens_as_token_ids`
    ("token_id:42"), read from the array's JSON: with each string's quotes and prefix taken out it is
    the array of ids, decoded in C. A Python loop over a 1024-token turn's strings took ~0.2 ms, and
    taking the prefixes out with bytes.replace ~0.06 ms, twice what the rest costs.
    Any other form (an escape in a token, say) is read string by string."""
    body = bytes(tokens)
    prefixed = body.count(_TOKEN_ID_QUOTED)
    if b"\\" not in body:  # no escaped quote: every quote opens or closes a string
        ids_json = body.translate(None, _TOKEN_ID_BYTES)
        # Each prefix opens a string of its own (JSON has nothing but `,`, `]` or blanks after a closing
        # quote), so there are at least as many strings, each with a closing quote. What translate took
        # out is exactly the prefixes and one closing quote each only if it is 11 bytes a prefix: then
        # the strings are as many as the prefixes, each the prefix and then what the ids are read from.
        if len(body) - len(ids_json) == prefixed * (len(_TOKEN_ID_QUOTED) + 1):
            try:
                ids = _IDS.decode(ids_json)
            except msgspec.DecodeError:
                pass
            else:
                if len(ids) == prefixed:
                    return ids
    return _ids_of_token_strings(msgspec.json.decode(body, type=list[str]))


def _ids_of_token_strings(tokens: list[str]) -> list[int]:
    joined = ",".join(tokens)
    if tokens and f",{joined}".count(f",{_TOKEN_ID_PREFIX}") != len(tokens):  # each one begins so
        raise ValueError('logprobs.tokens are not "token_id:<id>" (the server ignored return_tokens_as_token_ids)')
    # Only the prefix each token begins with goes: one inside a token is left to fail the decode.
    ids = _IDS.decode(f"[{f',{joined}'.replace(f',{_TOKEN_ID_PREFIX}', ',')[1:]}]".encode())
    if len(ids) != len(tokens):
        raise ValueError("logprobs.tokens are not one id each")
    return ids


def decode_completion(answer: HttpAnswer) -> _Answer:
    """The answer's body as typed data, decoded in one pass in C; ValueError when it is not JSON of
    that shape. A body msgspec refuses that the transport reads (a lone surrogate escape, made
    encodable by `HttpAnswer.json`) is decoded from what the transport made of it."""
    try:
        return _ANSWER.decode(answer.body)
    except msgspec.DecodeError as exc:
        try:
            data = answer.json()
        except ValueError:
            raise exc from None
        return _ANSWER.decode(dumps(data))


def parse_completion(
    answer: HttpAnswer, endpoint: str, model: str, latency: float, sent_prompt: list[int] | None = None
) -> Completion:
    """The answer as a Completion; raises ValueError (msgspec's errors are ones) on any shape it
    cannot use. With `sent_prompt` (token ids sent), the result holds the very list sent: the
    server's count of the prompt's tokens must be its length, and prompt ids it echoes anyway must be
    those (an echo of the same numbers in another JSON form, 1.0 for 1, passes: the ids kept are the
    ones sent)."""
    data = decode_completion(answer)
    raw_choices = data.choices
    if not raw_choices:
        raise ValueError("the answer has no choices")
    usage = data.usage or {}
    choices = []
    for raw in sorted(raw_choices, key=lambda c: c.index):
        logprobs = None
        raw_lp = raw.logprobs
        ids = raw.token_ids
        if raw_lp is not None:
            if raw_lp.content is not None:
                logprobs = [t.logprob for t in raw_lp.content]
            elif raw_lp.token_logprobs is not None:
                logprobs = raw_lp.token_logprobs
            if ids is None and sent_prompt is not None and _present(raw_lp.tokens):
                ids = _ids_of_tokens(raw_lp.tokens)
        if raw.message is not msgspec.UNSET:
            if raw.message is None:
                raise ValueError("message is null")
            text = raw.message.content
        elif raw.text is msgspec.UNSET:
            raise ValueError("a choice has neither text nor message")
        else:
            text = raw.text
        # Without ids (a non-vLLM server), the server's own count is what the env must be told.
        count = len(ids) if ids is not None else int(usage.get("completion_tokens") or 0) // len(raw_choices)
        choices.append(
            Choice(
                text=text or "",
                finish_reason=raw.finish_reason,
                completion_token_ids=ids,
                logprobs=logprobs,
                completion_tokens=count,
                stop_reason=raw.stop_reason,
            )
        )
    echoed = data.prompt_token_ids
    if not _present(echoed):
        echoed = raw_choices[0].prompt_token_ids
    prompt_ids: list[int] | None = None
    if sent_prompt is not None:
        if _present(echoed) and msgspec.json.decode(bytes(echoed)) != sent_prompt:
            raise ValueError("the prompt_token_ids echoed are not the prompt sent")
        # What says the server generated from these ids, now that they are not echoed: its own count.
        counted = usage.get("prompt_tokens")
        if counted != len(sent_prompt):
            raise ValueError(f"the server counted {counted} prompt tokens where {len(sent_prompt)} were sent")
        prompt_ids = sent_prompt
    elif _present(echoed):
        prompt_ids = _IDS.decode(bytes(echoed))
    return Completion(
        endpoint=endpoint,
        model=model if data.model is msgspec.UNSET else data.model,  # type: ignore[arg-type]
        prompt_token_ids=prompt_ids,
        prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or ())),
        choices=choices,
        latency_s=latency,
    )
