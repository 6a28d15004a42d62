"""Changing what a vLLM server serves: LoRA adapters at runtime, full weights reloaded from disk,
pause and resume around a trainer's own weight transfer.

The calls (vLLM 0.32, CPU build checked here):
- adapters: `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`; needs `--enable-lora` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the server;
- full weights: `POST /pause?mode=keep`, `POST /collective_rpc {"method": "reload_weights"}`,
  `POST /reset_prefix_cache` (KV cached under the old weights must not serve the new ones),
  `POST /update_weight_version`, `GET /weight_info`, `POST /weight_checker`, `POST /resume`; these
  need the server's dev mode (`VLLM_SERVER_DEV_MODE=1`).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import httpx

from .errors import MAX_DETAIL_CHARS, error_text
from .transport import (
    DEFAULT_MAX_ANSWER_BYTES,
    AddressPolicy,
    AddressRefused,
    AnswerTooLarge,
    EncodedAnswer,
    HttpAnswer,
    HttpTransport,
    TransportError,
    make_transport,
)


class WeightUpdateError(Exception):
    """A model server did not do what was asked; `status` is its HTTP status where it answered.
    `refused` (4xx) means it judged the request wrong (a bad path), not that it is unwell."""

    def __init__(self, url: str, action: str, detail: str, status: int | None = None) -> None:
        self.url, self.action, self.status = url, action, status
        self.detail = detail[:MAX_DETAIL_CHARS]
        super().__init__(f"{action} on {url}: {self.detail}")

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


class WeightsClient:
    """The weight-update calls of one or more vLLM servers: the admin side of a model server, apart
    from the replica pool's data plane, over the same HTTP stack and its rules (no netrc, proxies
    read once, answers capped)."""

    def __init__(
        self,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        *,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
        address_policy: AddressPolicy | None = None,
    ) -> None:
        """`transport`: an httpx transport standing in for the servers (tests). Reloading a large
        checkpoint can take minutes: `timeout_s` is long, the connect timeout stays short.
        `address_policy`: where it may connect (see CheckedResolver)."""
        self._http: HttpTransport = make_transport(
            timeout_s, transport, max_answer_bytes=max_answer_bytes, address_policy=address_policy
        )
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        url: str,
        action: str,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-request deadline, passed to the transport
    ) -> HttpAnswer:
        target = f"{url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            response = await self._http.request(method, target, json=json, headers=self._headers, timeout=timeout)
        except (AnswerTooLarge, EncodedAnswer) as exc:
            # It answered: what it sent was refused unread, which says nothing of whether it is up.
            raise WeightUpdateError(url, action, f"its answer was refused: {exc}") from None
        except AddressRefused as exc:
            raise WeightUpdateError(url, action, f"not connected to: {exc}") from None
        except TransportError as exc:
            raise WeightUpdateError(url, action, f"unreachable: {exc}") from None
        if response.status == 404 and "Not Found" in response.text[:100]:
            raise WeightUpdateError(
                url,
                action,
                f"{path} is not served: adapters need vLLM started with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; pause and full weights need VLLM_SERVER_DEV_MODE=1",
                404,
            )
        if response.status >= 400:
            raise WeightUpdateError(url, action, error_text(response), response.status)
        return response

    async def _json(self, url: str, action: str, method: str, path: str, **kwargs: Any) -> dict:
        response = await self._call(url, action, method, path, **kwargs)
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise WeightUpdateError(url, action, f"answered something that is not a JSON object: {response.text[:200]}")
        return data

    async def models(self, url: str) -> list[str]:
        data = await self._json(url, "list models", "GET", "/v1/models", timeout=10.0)
        try:
            return [str(m["id"]) for m in data.get("data", [])]
        except (TypeError, KeyError) as exc:
            raise WeightUpdateError(url, "list models", f"an unexpected model list: {exc}") from None

    async def load_adapter(self, url: str, name: str, path: str) -> None:
        # load_inplace: a name left loaded by an earlier service on the same server is replaced.
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self._call(url, "load adapter", "POST", "/v1/load_lora_adapter", json=body)

    async def unload_adapter(self, url: str, name: str) -> None:
        await self._call(url, "unload adapter", "POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def pause(self, url: str) -> None:
        """Freeze generation, keeping requests in flight: they go on after resume (on new weights)."""
        await self._call(url, "pause", "POST", "/pause", params={"mode": "keep"}, timeout=60.0)

    async def resume(self, url: str) -> None:
        await self._call(url, "resume", "POST", "/resume", timeout=60.0)

    async def reload_weights(self, url: str, path: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self._call(url, "reload weights", "POST", "/collective_rpc", json=body)

    async def reset_prefix_cache(self, url: str) -> None:
        """Drop the KV blocks cached under the weights just replaced. vLLM keys its prefix cache by
        tokens (and adapter), not by weights: without this, turns on new weights reuse prompts' KV
        computed by the old ones (seen here: logprobs off by 0.18 nats on average). Requests in
        flight are preempted and recomputed on the new weights."""
        data = await self._json(
            url, "reset prefix cache", "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}
        )
        if data.get("success") is not True:
            raise WeightUpdateError(url, "reset prefix cache", f"the server did not reset it: {data}")

    async def checksums(self, url: str) -> dict[str, str]:
        data = await self._json(url, "checksum weights", "POST", "/weight_checker", json={"action": "checksum"})
        return dict(data.get("checksums") or {})

    async def set_version(self, url: str, version: str) -> None:
        await self._call(url, "set weight version", "POST", "/update_weight_version", json={"new_version": version})

    async def version(self, url: str) -> str | None:
        """The label the server's weights carry (`update_weight_version`); a restarted server says 'default'."""
        data = await self._json(url, "read weight version", "GET", "/weight_info", timeout=10.0)
        label = data.get("weight_version")
        return None if label is None else str(label)

    async def is_paused(self, url: str) -> bool:
        data = await self._json(url, "read pause state", "GET", "/is_paused", timeout=10.0)
        return bool(data.get("is_paused"))
