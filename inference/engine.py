"""One model server's calls: what the service asks of an engine, and the client for vLLM's
OpenAI-compatible server that does it over HTTP.

`Engine` is the interface: a test double or another engine's server (SGLang's OpenAI server, say)
implements these four calls and the replica pool (inference/replicas.py) routes over it unchanged.
Each call raises an InferenceError subclass (inference/errors.py) when it gets no usable answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from .answers import Completion, TokenizeAnswer, normalize_response_format, parse_completion, structured_output
from .errors import (
    CONTEXT_OVERFLOW,
    AddressNotAllowed,
    BadInferenceResponse,
    ContextOverflow,
    InferenceAnswerTooLarge,
    InferenceError,
    InferenceRejected,
    InferenceServerError,
    InferenceTimeout,
    InferenceUnreachable,
    error_text,
)
from .transport import (
    AddressRefused,
    AnswerTooLarge,
    EncodedAnswer,
    HttpAnswer,
    HttpTransport,
    TransportError,
    TransportTimeout,
)


class Engine(Protocol):
    """The calls the service makes of one model server."""

    url: str

    async def models(self) -> list[str]:
        """The models it serves."""
        ...

    async def chat(
        self, *, model: str, messages: list[dict], sampling: Mapping[str, Any], n: int, response_format: Any
    ) -> Completion:
        """`messages` rendered by the server's chat template and completed."""
        ...

    async def complete(
        self, *, model: str, prompt_token_ids: list[int], sampling: Mapping[str, Any], response_format: Any
    ) -> Completion:
        """A prompt given as token ids, completed: the answer's prompt ids are the very list sent."""
        ...

    async def tokenize(
        self, *, model: str, messages: list[dict] | None, text: str | None, add_generation_prompt: bool
    ) -> TokenizeAnswer:
        """`messages` as the chat template renders them, or plain `text` without special tokens."""
        ...


class VllmServer:
    """vLLM's OpenAI-compatible server at `url` (a base without /v1), over a transport shared with the
    other servers of its pool. `token_ids`: ask chat completions for token ids and logprobs (vLLM's
    extensions; false for another OpenAI-compatible server)."""

    def __init__(self, url: str, http: HttpTransport, *, api_key: str | None = None, token_ids: bool = True) -> None:
        self.url = url
        self.token_ids = token_ids
        self._http = http
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def models(self) -> list[str]:
        """Raises InferenceUnreachable (no answer), InferenceServerError (5xx), InferenceRejected (4xx;
        its `status` says which) or ValueError (not a model list)."""
        try:
            response = await self._http.request("GET", f"{self.url}/v1/models", headers=self._headers, timeout=10.0)
        except TransportError as exc:  # a timeout too: the start-up probe asks again, as for no answer
            raise _transport_failure(exc, self.url, "/v1/models") from None
        if response.status >= 400:
            cls = InferenceServerError if response.status >= 500 else InferenceRejected
            raise cls(error_text(response), response.status)
        body = response.json()
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise ValueError(f"GET /v1/models is not an OpenAI model list: {response.text[:200]!r}")
        return [m["id"] for m in data]

    async def chat(
        self, *, model: str, messages: list[dict], sampling: Mapping[str, Any], n: int = 1, response_format: Any = None
    ) -> Completion:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "n": n,
            **{k: v for k, v in sampling.items() if v is not None},
        }
        if self.token_ids:
            body.update(logprobs=True, return_token_ids=True)
        rf = normalize_response_format(response_format)
        if rf is not None:
            body["response_format"] = rf
        return await self._generate("/v1/chat/completions", body, model)

    async def complete(
        self, *, model: str, prompt_token_ids: list[int], sampling: Mapping[str, Any], response_format: Any = None
    ) -> Completion:
        """The env's response_format becomes a structured-output constraint, as the chat endpoint would
        apply it."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt_token_ids,
            **{k: v for k, v in sampling.items() if v is not None},
            "logprobs": 0,  # the sampled token's own logprob only
            # Each sampled token as "token_id:<id>" beside its logprob. Not `return_token_ids`: that
            # echoes the prompt's ids too, thousands a turn that the service sent itself.
            "return_tokens_as_token_ids": True,
        }
        if sampling.get("stop"):
            # The ids include the tokens that formed a stop string; so must the text the env sees, or the
            # trajectory would hold tokens whose text the env never got.
            body["include_stop_str_in_output"] = True
        constraint = structured_output(response_format)
        if constraint is not None:
            body["structured_outputs"] = constraint
        return await self._generate("/v1/completions", body, model, sent_prompt=prompt_token_ids)

    async def tokenize(
        self,
        *,
        model: str,
        messages: list[dict] | None = None,
        text: str | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenizeAnswer:
        """The answer, unread (its ids in whole, or only those after ids the caller knows). A server
        without /tokenize answers InferenceRejected(404)."""
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=add_generation_prompt)
        else:
            body.update(prompt=text or "", add_special_tokens=False)
        return TokenizeAnswer((await self._post("/tokenize", body)).body)

    async def _generate(
        self, path: str, body: dict[str, Any], model: str, sent_prompt: list[int] | None = None
    ) -> Completion:
        started = time.monotonic()
        response = await self._post(path, body)
        latency = time.monotonic() - started
        try:
            return parse_completion(response.json(), self.url, model, latency, sent_prompt)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise BadInferenceResponse(f"unexpected completion shape: {type(exc).__name__}: {exc}") from None

    async def _post(self, path: str, body: dict[str, Any]) -> HttpAnswer:
        """A 2xx answer, or the InferenceError that says why not."""
        try:
            response = await self._http.request("POST", f"{self.url}{path}", json=body, headers=self._headers)
        except TransportTimeout:
            raise InferenceTimeout(f"{self.url}: no answer in time") from None
        except TransportError as exc:
            raise _transport_failure(exc, self.url, path) from None
        if response.status >= 400:
            detail = error_text(response)
            if response.status >= 500:
                raise InferenceServerError(detail, response.status)
            if CONTEXT_OVERFLOW.search(detail):
                raise ContextOverflow(detail, response.status)
            raise InferenceRejected(detail, response.status)
        return response


def _transport_failure(exc: TransportError, url: str, path: str) -> InferenceError:
    """What a failed exchange with a model server means, but for a timeout (each call names its own)."""
    if isinstance(exc, AnswerTooLarge):
        return InferenceAnswerTooLarge(f"{url}{path}: {exc}")
    if isinstance(exc, EncodedAnswer):
        return BadInferenceResponse(f"{url}{path}: {exc}")
    if isinstance(exc, AddressRefused):
        return AddressNotAllowed(f"{url}: {exc}")
    return InferenceUnreachable(f"{url}: {exc}")
