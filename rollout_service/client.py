"""Trainer-side client: ask the service for groups, get typed results back.

    from rollout_service.client import RolloutClient
    client = RolloutClient("http://127.0.0.1:8080")
    group = client.group(task_id="t001", n=8, sampling={"temperature": 0.8, "max_tokens": 128})
    for attempt in group.attempts: ...
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterable, Iterator

import httpx

from .advantages import group_advantages
from .schemas import GroupRequest, GroupResult

__all__ = ["RolloutClient", "AsyncRolloutClient", "RolloutError", "BatchItem", "group_advantages"]


class RolloutError(Exception):
    """The service refused a request or a group failed; `status` and `error` as it said them."""

    def __init__(self, status: int | None, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.status, self.error, self.message = status, error, message


class BatchItem:
    """One line of a batch stream: the group at `index` of the request, or why it failed."""

    def __init__(self, index: int, group: GroupResult | None, error: RolloutError | None) -> None:
        self.index, self.group, self.error = index, group, error

    def __repr__(self) -> str:
        return f"BatchItem(index={self.index}, {'ok' if self.group else self.error})"


def _request_body(request: GroupRequest | dict | None, fields: dict[str, Any]) -> dict:
    if request is None:
        request = GroupRequest.model_validate(fields)
    elif isinstance(request, dict):
        request = GroupRequest.model_validate({**request, **fields})
    return request.model_dump(mode="json", exclude_none=True, exclude_defaults=False)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        data = response.json()
        raise RolloutError(response.status_code, data.get("error", "http_error"), data.get("message", response.text))
    except ValueError:
        raise RolloutError(response.status_code, "http_error", response.text[:500]) from None


def _parse_line(line: str) -> BatchItem:
    item = json.loads(line)
    if "group" in item:
        return BatchItem(item["index"], GroupResult.model_validate(item["group"]), None)
    err = item.get("error") or {}
    return BatchItem(item["index"], None, RolloutError(None, err.get("error", "group_failed"), err.get("message", "")))


class RolloutClient:
    """Synchronous client. `api_key` is sent as a bearer token when the service asks for one."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        """Run one group and wait for it."""
        response = self._http.post("/groups", json=_request_body(request, fields))
        _raise_for(response)
        return GroupResult.model_validate(response.json())

    def groups(self, requests: Iterable[GroupRequest | dict]) -> Iterator[BatchItem]:
        """Run many groups; yield each as soon as it finishes (not in request order)."""
        body = {"groups": [_request_body(r, {}) for r in requests]}
        with self._http.stream("POST", "/groups/batch", json=body) as response:
            if response.status_code >= 400:
                response.read()
                _raise_for(response)
            for line in response.iter_lines():
                if line.strip():
                    yield _parse_line(line)

    def health(self) -> dict:
        response = self._http.get("/health")
        _raise_for(response)
        return response.json()


class AsyncRolloutClient:
    """Asynchronous client, same calls as RolloutClient."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        response = await self._http.post("/groups", json=_request_body(request, fields))
        _raise_for(response)
        return GroupResult.model_validate(response.json())

    async def groups(self, requests: Iterable[GroupRequest | dict]) -> AsyncIterator[BatchItem]:
        body = {"groups": [_request_body(r, {}) for r in requests]}
        async with self._http.stream("POST", "/groups/batch", json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for(response)
            async for line in response.aiter_lines():
                if line.strip():
                    yield _parse_line(line)

    async def health(self) -> dict:
        response = await self._http.get("/health")
        _raise_for(response)
        return response.json()
