"""One model server's calls: what the service asks of an engine, and the client for vLLM's
OpenAI-compatible server that does it over HTTP.

`Engine` is the interface: a test double or another engine's server (SGLang's OpenAI server, say)
implements these calls, and the replica pool (rollout_service/backends/replica_pool.py) and the policy manager
(rollout_service/server/policy/manager.py) use it unchanged. The generation calls raise an InferenceError
subclass (rollout_service/backends/errors.py) when they get no usable answer; the calls that change what the
server serves (adapters, weights, pause) raise WeightUpdateError.

vLLM's routes for the latter (0.32, CPU build checked here):
- adapters: `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`; needs `--enable-lora` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the server;
- full weights: `POST /pause?mode=keep`, `POST /collective_rpc {"method": "reload_weights"}`,
  `POST /reset_prefix_cache` (KV cached under the old weights must not serve the new ones),
  `POST /update_weight_version`, `GET /weight_info`, `POST /weight_checker`, `POST /resume`; these
  need the server's dev mode (`VLLM_SERVER_DEV_MODE=1`).
"""

from __future__ import annotations

import time
import urllib.parse
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
    WeightUpdateError,
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

    # -- what it serves, changed (each raises WeightUpdateError) --------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` as model `name` (replacing one of that name)."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    async def pause(self) -> None:
        """Freeze generation, keeping requests in flight: they go on after resume (on new weights)."""
        ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def reload_weights(self, path: str) -> None:
        """Replace the full weights by the checkpoint at `path`, in place."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop the KV cached under the weights just replaced (requests in flight recomputed)."""
        ...

    async def weight_checksums(self) -> dict[str, str]:
        """A digest per weight tensor: whether a reload changed anything."""
        ...

    async def set_weight_version(self, label: str) -> None:
        """Label the weights served (read back by weight_version, kept until the server restarts)."""
        ...

    async def weight_version(self) -> str | None:
        """The weights' label; a restarted server says 'default'."""
        ...


class VllmServer:
    """vLLM's OpenAI-compatible server at `url` (a base without /v1), over a transport shared with the
    other servers of its pool. `token_ids`: ask chat completions for token ids and logprobs (vLLM's
    extensions; false for another OpenAI-compatible server). `update_timeout_s`: the deadline of an
    adapter load or a weight reload (a large checkpoint takes minutes); the connect timeout stays short."""

    def __init__(
        self,
        url: str,
        http: HttpTransport,
        *,
        api_key: str | None = None,
        token_ids: bool = True,
        update_timeout_s: float = 600.0,
    ) -> None:
        self.url = url
        self.token_ids = token_ids
        self.update_timeout_s = update_timeout_s
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
            return parse_completion(response, self.url, model, latency, sent_prompt)
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

    # -- what it serves, changed ----------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        # load_inplace: a name left loaded by an earlier service on the same server is replaced.
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self._admin("load adapter", "POST", "/v1/load_lora_adapter", json=body)

    async def unload_adapter(self, name: str) -> None:
        await self._admin("unload adapter", "POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def pause(self) -> None:
        await self._admin("pause", "POST", "/pause", params={"mode": "keep"}, timeout=60.0)

    async def resume(self) -> None:
        await self._admin("resume", "POST", "/resume", timeout=60.0)

    async def is_paused(self) -> bool:
        data = await self._admin_json("read pause state", "GET", "/is_paused", timeout=10.0)
        return bool(data.get("is_paused"))

    async def reload_weights(self, path: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._admin("reload weights", "POST", "/collective_rpc", json=body)

    async def reset_prefix_cache(self) -> None:
        """vLLM keys its prefix cache by tokens (and adapter), not by weights: without this, turns on
        new weights reuse prompts' KV computed by the old ones (seen here: logprobs off by 0.18 nats
        on average). Requests in flight are preempted and recomputed on the new weights."""
        data = await self._admin_json(
            "reset prefix cache", "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}
        )
        if data.get("success") is not True:
            raise WeightUpdateError(self.url, "reset prefix cache", f"the server did not reset it: {data}")

    async def weight_checksums(self) -> dict[str, str]:
        data = await self._admin_json("checksum weights", "POST", "/weight_checker", json={"action": "checksum"})
        return dict(data.get("checksums") or {})

    async def set_weight_version(self, label: str) -> None:
        await self._admin("set weight version", "POST", "/update_weight_version", json={"new_version": label})

    async def weight_version(self) -> str | None:
        data = await self._admin_json("read weight version", "GET", "/weight_info", timeout=10.0)
        label = data.get("weight_version")
        return None if label is None else str(label)

    async def _admin(
        self,
        action: str,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-request deadline, passed to the transport
    ) -> HttpAnswer:
        """A 2xx answer to a call that changes what the server serves, or the WeightUpdateError that
        says why not (a route not served: which of vLLM's switches it needs)."""
        target = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            response = await self._http.request(
                method, target, json=json, headers=self._headers, timeout=timeout or self.update_timeout_s
            )
        except (AnswerTooLarge, EncodedAnswer) as exc:
            # It answered: what it sent was refused unread, which says nothing of whether it is up.
            raise WeightUpdateError(self.url, action, f"its answer was refused: {exc}") from None
        except AddressRefused as exc:
            raise WeightUpdateError(self.url, action, f"not connected to: {exc}") from None
        except TransportError as exc:
            raise WeightUpdateError(self.url, action, f"unreachable: {exc}") from None
        if response.status == 404 and "Not Found" in response.text[:100]:
            raise WeightUpdateError(
                self.url,
                action,
                f"{path} is not served: adapters need vLLM started with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; pause and full weights need VLLM_SERVER_DEV_MODE=1",
                404,
            )
        if response.status >= 400:
            raise WeightUpdateError(self.url, action, error_text(response), response.status)
        return response

    async def _admin_json(self, action: str, method: str, path: str, **kwargs: Any) -> dict:
        response = await self._admin(action, method, path, **kwargs)
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise WeightUpdateError(
                self.url, action, f"answered something that is not a JSON object: {response.text[:200]}"
            )
        return data


def _transport_failure(exc: TransportError, url: str, path: str) -> InferenceError:
    """What a failed exchange with a model server means, but for a timeout (each call names its own)."""
    if isinstance(exc, AnswerTooLarge):
        return InferenceAnswerTooLarge(f"{url}{path}: {exc}")
    if isinstance(exc, EncodedAnswer):
        return BadInferenceResponse(f"{url}{path}: {exc}")
    if isinstance(exc, AddressRefused):
        return AddressNotAllowed(f"{url}: {exc}")
    return InferenceUnreachable(f"{url}: {exc}")
