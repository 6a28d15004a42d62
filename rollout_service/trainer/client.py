"""Trainer-side client: ask the service for groups, get typed results back.

    from rollout_service.trainer import RolloutClient
    client = RolloutClient("http://127.0.0.1:8080")
    group = client.group(task_id="t001", n=8, sampling={"temperature": 0.8, "max_tokens": 128})
    for attempt in group.attempts: ...

`RolloutClient` and `AsyncRolloutClient` share `_BaseClient`: requests are built and answers
parsed in one place; only the transport differs. Errors are a hierarchy under `RolloutError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from rollout_service import ndjson

from ..keys import client_keys
from ..protocol import (
    EnvAdd,
    EnvRef,
    EnvRemove,
    EnvRemoved,
    EnvState,
    GroupRequest,
    GroupResult,
    PolicyState,
    PolicyUpdate,
    PolicyUpdateResult,
    ReplicaAdd,
    ReplicaRef,
    ReplicaRemove,
    ReplicaState,
    describe_errors,
)
from ..retry import Backoff
from ..sampler_protocol import (
    DroppedGroup,
    SampleRequest,
    SampleSummary,
    StreamCreate,
    StreamPull,
    StreamState,
    TaskStats,
)

__all__ = [
    "RolloutClient",
    "AsyncRolloutClient",
    "BatchItem",
    "RolloutError",
    "RequestRejected",
    "ServiceBusy",
    "ServiceUnavailable",
    "ServiceStarting",
    "GroupFailed",
    "Sampled",
    "StreamCut",
]


class RolloutError(Exception):
    """The service refused a request, or a group failed; `status` and `error` as it said them."""

    def __init__(self, status: int | None, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.status, self.error, self.message = status, error, message


class RequestRejected(RolloutError):
    """4xx: the request cannot be served as sent (unknown task, bad field, n too large...); fix it.
    `status` None: the client's own check refused it (`invalid_request`, naming the field), so nothing
    was sent; the pydantic error is its `__cause__`."""


class ServiceBusy(RolloutError):
    """429: too many attempts are queued; send it again after `retry_after_s`."""

    def __init__(self, status: int | None, error: str, message: str, retry_after_s: float | None) -> None:
        super().__init__(status, error, message)
        self.retry_after_s = retry_after_s


class ServiceUnavailable(RolloutError):
    """5xx: the service is shutting down or failed; send the request to a running service."""


class ServiceStarting(ServiceUnavailable):
    """503 `starting`: the service is still waiting for its envs or model servers (the message says
    which); `wait_ready()` waits for it."""

    def __init__(self, status: int | None, error: str, message: str, retry_after_s: float | None) -> None:
        super().__init__(status, error, message)
        self.retry_after_s = retry_after_s


class GroupFailed(RolloutError):
    """One group of a batch could not be run (its line in the stream carries an error)."""


@dataclass
class BatchItem:
    """One line of a batch stream: the group at `index` of the request, or why it failed."""

    index: int
    group: GroupResult | None
    error: GroupFailed | None


@dataclass
class Sampled:
    """A sample's (or a pull's) answer: the groups kept, in the order they finished; the dropped
    groups' lines; the summary (why it stopped, what was spent). A pull also says each group's lag."""

    groups: list[GroupResult]
    dropped: list[DroppedGroup]
    summary: SampleSummary
    lags: list[int]


class StreamCut(ServiceUnavailable):
    """A sample's or a pull's answer ended before its summary line: the connection was cut (the service
    went away, or cut off a reader that took nothing for its --stream-stall-timeout, or the client's own
    read timeout passed). What did arrive is here: `groups` (with `lags`, for a pull) and `dropped`.
    A pull's groups that arrived were handed out by the stream and will not come again; pull again
    for the rest (the stream lives on)."""

    def __init__(self, message: str, groups: list[GroupResult], dropped: list[DroppedGroup], lags: list[int]) -> None:
        super().__init__(None, "stream_cut", message)
        self.groups, self.dropped, self.lags = groups, dropped, lags


class _SampleReader:
    """The lines of a sample or a pull, gathered."""

    def __init__(self) -> None:
        self.groups: list[GroupResult] = []
        self.dropped: list[DroppedGroup] = []
        self.lags: list[int] = []
        self.summary: SampleSummary | None = None

    def cut(self, why: str) -> StreamCut:
        return StreamCut(
            f"the answer was cut off before its summary line ({why}) after {len(self.groups)} groups and "
            f"{len(self.dropped)} dropped lines; those that arrived are on this error",
            self.groups,
            self.dropped,
            self.lags,
        )

    def add(self, line: str) -> None:
        if not line.strip():
            return
        try:
            item = json.loads(line)
        except ValueError:  # the last line, cut in the middle
            raise self.cut("its last line came in part") from None
        if "group" in item:
            self.groups.append(GroupResult.model_validate(item["group"]))
            if "lag" in item:
                self.lags.append(item["lag"])
        elif "dropped" in item:
            self.dropped.append(DroppedGroup.model_validate(item["dropped"]))
        elif "summary" in item:
            self.summary = SampleSummary.model_validate(item["summary"])

    def result(self) -> Sampled:
        if self.summary is None:
            raise self.cut("the answer ended without it")
        return Sampled(self.groups, self.dropped, self.summary, self.lags)


# What wait_ready() waits through: nothing listening yet, a 5xx or 429 (a proxy in front of a
# service not up yet), an answer that is not JSON (a proxy's error page).
_NOT_READY_YET = (httpx.TransportError, ServiceUnavailable, ServiceBusy, ValueError)


_Body = TypeVar("_Body", bound=BaseModel)


def _checked(model: type[_Body], data: Any) -> _Body:
    """`data` as `model`, or RequestRejected: a bad field is the caller's to fix, whether the service
    or this check finds it (a bare ValidationError would escape the client's error hierarchy)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestRejected(None, "invalid_request", describe_errors(exc.errors())) from exc


class _BaseClient:
    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        key_file: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        api_key, admin_key = client_keys(api_key, admin_key, key_file)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Sent instead on the admin plane (membership, policy updates and pause).
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._timeout = timeout_s

    @staticmethod
    def _group_body(request: GroupRequest | dict | None, fields: dict[str, Any]) -> dict:
        if request is None:
            request = _checked(GroupRequest, fields)
        elif isinstance(request, dict):
            request = _checked(GroupRequest, {**request, **fields})
        body = request.model_dump(mode="json", exclude_none=True)
        for name, field in GroupRequest.model_fields.items():
            # A null where the default is not one is a choice, not an absence: policy_failure_reward
            # null excludes such attempts, where left out it would be the service's 0.0.
            if getattr(request, name) is None and field.default is not None:
                body[name] = None
        return body

    @classmethod
    def _batch_group_body(cls, position: int, request: GroupRequest | dict) -> dict:
        """One group of a batch; a refusal names its place in the batch."""
        try:
            return cls._group_body(request, {})
        except RequestRejected as exc:
            raise RequestRejected(None, exc.error, f"groups[{position}]: {exc.message}") from exc.__cause__

    @classmethod
    def _batch_body(cls, requests: Iterable[GroupRequest | dict]) -> dict:
        return {"groups": [cls._batch_group_body(i, r) for i, r in enumerate(requests)]}

    @staticmethod
    def _body(model: type[BaseModel], **fields: Any) -> dict:
        return _checked(model, fields).model_dump()

    @staticmethod
    def _body_json(model: type[BaseModel], fields: dict[str, Any]) -> dict:
        return _checked(model, fields).model_dump(mode="json", exclude_none=True)

    @staticmethod
    def _update_body(version: str, lora: str | None, weights: str | None) -> dict:
        update = _checked(
            PolicyUpdate,
            {
                "version": version,
                **({"lora": {"path": lora}} if lora else {}),
                **({"weights": {"path": weights}} if weights else {}),
            },
        )
        return update.model_dump(mode="json", exclude_none=True)

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            data = response.json()
            error, message = str(data.get("error", "http_error")), str(data.get("message", response.text))
        except (ValueError, AttributeError):
            error, message = "http_error", response.text[:500]
        retry = response.headers.get("retry-after")
        retry_after_s = float(retry) if retry and retry.isdigit() else None
        if response.status_code == 429:
            raise ServiceBusy(429, error, message, retry_after_s)
        if response.status_code == 503 and error == "starting":
            raise ServiceStarting(503, error, message, retry_after_s)
        cls = ServiceUnavailable if response.status_code >= 500 else RequestRejected
        raise cls(response.status_code, error, message)

    @staticmethod
    def _health(response: httpx.Response) -> dict:
        """/health's body, also on its 503 while starting or after a failed start: an answer, not an error."""
        if response.status_code == 503:
            try:
                body = response.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("status") in ("starting", "failed"):
                return body
        _BaseClient._raise_for(response)
        return response.json()

    @staticmethod
    def _ask_timeout(started: float, timeout_s: float) -> float:
        """One /health question: at most 10 s, and not much past the caller's deadline."""
        return min(10.0, max(1.0, timeout_s - (time.monotonic() - started)))

    def _ready_or_wait(self, answer: dict | Exception, started: float, timeout_s: float) -> bool:
        """True once /health says the service serves; raises once `timeout_s` has passed."""
        if isinstance(answer, dict) and answer.get("status") in ("ok", "degraded"):
            return True
        if isinstance(answer, dict) and answer.get("status") == "failed":
            raise ServiceUnavailable(
                None, "start_failed", f"{self.url} could not start (GET /health/detail says why); waiting will not help"
            )
        if time.monotonic() - started > timeout_s:
            why = f"/health says {answer.get('status')!r}" if isinstance(answer, dict) else f"{answer}"
            raise ServiceUnavailable(None, "not_ready", f"{self.url} was not ready within {timeout_s:g}s ({why})")
        return False

    @staticmethod
    def _parse_line(line: str) -> BatchItem:
        item = json.loads(line)
        if "group" in item:
            return BatchItem(item["index"], GroupResult.model_validate(item["group"]), None)
        err = item.get("error") or {}
        return BatchItem(
            item["index"], None, GroupFailed(None, err.get("error", "group_failed"), err.get("message", ""))
        )


class RolloutClient(_BaseClient):
    """Synchronous client. Keys: `api_key` (the data plane's: groups, tasks) and `admin_key` (the admin
    plane's: envs, replicas, policy updates and pause; default `api_key`), else those in `key_file`
    (as compose and `ray up` write it), else $ROLLOUT_API_KEY and $ROLLOUT_ADMIN_KEY. Each call
    sends its plane's key as a bearer token."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        key_file: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(url, api_key=api_key, admin_key=admin_key, key_file=key_file, timeout_s=timeout_s)
        self._http = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout_s)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        """Run one group and wait for it."""
        response = self._http.post("/groups", json=self._group_body(request, fields))
        self._raise_for(response)
        return GroupResult.model_validate_json(response.content)

    def groups(self, requests: Iterable[GroupRequest | dict]) -> Iterator[BatchItem]:
        """Run many groups; yield each as soon as it finishes (not in request order)."""
        with self._http.stream("POST", "/groups/batch", json=self._batch_body(requests)) as response:
            if response.status_code >= 400:
                response.read()
                self._raise_for(response)
            for line in ndjson.lines(response.iter_bytes()):
                if line.strip():
                    yield self._parse_line(line)

    def tasks(self) -> list[dict]:
        return self._get("/tasks")["tasks"]

    def health(self) -> dict:
        """Status only: ok, degraded, starting or failed."""
        return self._health(self._http.get("/health"))

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> dict:
        """Wait until the service serves (it may still be starting, or not listening yet, when a
        trainer starts beside it); its /health. Raises ServiceUnavailable after `timeout_s`, or at once
        when the service says its start failed (one run by the CLI exits instead: that is waited out)."""
        started, pause = time.monotonic(), Backoff(poll_s, poll_s)
        while True:
            answer: dict | Exception
            try:
                answer = self._health(self._http.get("/health", timeout=self._ask_timeout(started, timeout_s)))
            except _NOT_READY_YET as exc:
                answer = exc
            if self._ready_or_wait(answer, started, timeout_s):
                assert isinstance(answer, dict)
                return answer
            time.sleep(pause.take())

    def health_detail(self) -> dict:
        """Each env and model server as last probed, the run log, the queues."""
        return self._get("/health/detail")

    def policy(self) -> PolicyState:
        """The version served, each replica's, and the recent updates."""
        return PolicyState.model_validate(self._get("/policy"))

    def update_policy(self, version: str, *, lora: str | None = None, weights: str | None = None) -> PolicyUpdateResult:
        """Serve `version` from now on: a LoRA adapter folder (`lora`), a full checkpoint folder
        (`weights`), or, with neither, the weights pushed into the replicas after `pause_policy()`.
        Paths are as the model servers see them."""
        response = self._http.post(
            "/policy", json=self._update_body(version, lora, weights), timeout=None, headers=self._admin_headers
        )
        self._raise_for(response)
        return PolicyUpdateResult.model_validate_json(response.content)

    def pause_policy(self, timeout_s: float | None = None) -> PolicyState:
        """Hold the policy replicas paused (turns in flight freeze) while you push weights yourself, for
        `timeout_s` at most (default: the service's --pause-timeout); calling it again renews the lease."""
        response = self._http.post("/policy/pause", json={"timeout_s": timeout_s}, headers=self._admin_headers)
        self._raise_for(response)
        return PolicyState.model_validate_json(response.content)

    def envs(self) -> list[EnvState]:
        """The envs the service schedules on: pool, worlds held, draining or not."""
        return [EnvState.model_validate(e) for e in self._get("/envs", self._admin_headers)]

    def add_env(self, url: str, *, timeout_s: float = 60.0) -> EnvState:
        """Schedule on one more env server (it must match the dataset and reward version of the
        envs serving the same tasks: RequestRejected env_incomparable otherwise)."""
        response = self._http.post(
            "/envs", json=self._body(EnvAdd, url=url, timeout_s=timeout_s), timeout=None, headers=self._admin_headers
        )
        self._raise_for(response)
        return EnvState.model_validate_json(response.content)

    def drain_env(self, url: str) -> EnvState:
        """Start no new episode on the env; the ones on it finish."""
        response = self._http.post("/envs/drain", json=self._body(EnvRef, url=url), headers=self._admin_headers)
        self._raise_for(response)
        return EnvState.model_validate_json(response.content)

    def remove_env(self, url: str, *, timeout_s: float = 300.0) -> EnvRemoved:
        """Drain the env, wait up to `timeout_s` for its episodes to finish, then stop scheduling on
        it (RequestRejected env_busy if some still run then: it stays draining)."""
        body = self._body(EnvRemove, url=url, timeout_s=timeout_s)
        response = self._http.post("/envs/remove", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return EnvRemoved.model_validate_json(response.content)

    def add_replica(
        self, url: str, *, role: str = "policy", timeout_s: float = 300.0, api_key_env: str | None = None
    ) -> ReplicaState:
        """Route to one more model server replica; a policy one once it serves the current version
        (`routed` says whether it does by `timeout_s`). RequestRejected `policy_busy` if a policy
        update still runs at `timeout_s` (a replica joins between them): add it again. `api_key_env`: the
        variable in the service's environment holding the key the replica requires (default the route's)."""
        body = self._body(ReplicaAdd, url=url, role=role, timeout_s=timeout_s, api_key_env=api_key_env)
        response = self._http.post("/replicas", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return ReplicaState.model_validate_json(response.content)

    def drain_replica(self, url: str, *, role: str = "policy") -> ReplicaState:
        """Send no new turn to the replica; groups pinned there move at their next turn."""
        body = self._body(ReplicaRef, url=url, role=role)
        response = self._http.post("/replicas/drain", json=body, headers=self._admin_headers)
        self._raise_for(response)
        return ReplicaState.model_validate_json(response.content)

    def remove_replica(self, url: str, *, role: str = "policy", timeout_s: float = 300.0) -> ReplicaState:
        """Drain the replica, wait up to `timeout_s` for its requests in flight, stop routing to it."""
        body = self._body(ReplicaRemove, url=url, role=role, timeout_s=timeout_s)
        response = self._http.post("/replicas/remove", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return ReplicaState.model_validate_json(response.content)

    def sample(self, **fields: Any) -> Sampled:
        """POST /groups/sample: `count` groups with signal (see SampleRequest for the fields)."""
        return self._sampled("/groups/sample", self._body_json(SampleRequest, fields))

    def open_stream(self, **fields: Any) -> StreamState:
        """POST /samplers: a stream generating into a bounded buffer (see StreamCreate)."""
        response = self._http.post("/samplers", json=self._body_json(StreamCreate, fields))
        self._raise_for(response)
        return StreamState.model_validate_json(response.content)

    def pull(self, stream_id: str, count: int, *, timeout_s: float = 3600) -> Sampled:
        """`count` groups from a stream, each with its lag. RequestRejected 410/404 once it is gone."""
        body = self._body_json(StreamPull, {"count": count, "timeout_s": timeout_s})
        return self._sampled(f"/samplers/{stream_id}/pull", body)

    def stream_state(self, stream_id: str) -> StreamState:
        return StreamState.model_validate(self._get(f"/samplers/{stream_id}"))

    def close_stream(self, stream_id: str) -> StreamState:
        response = self._http.delete(f"/samplers/{stream_id}")
        self._raise_for(response)
        return StreamState.model_validate_json(response.content)

    def task_stats(self, task_ids: list[str] | None = None) -> list[TaskStats]:
        response = self._http.get("/tasks/stats", params={"task_id": task_ids} if task_ids else None)
        self._raise_for(response)
        return [TaskStats.model_validate(t) for t in response.json()]

    def _sampled(self, path: str, body: dict) -> Sampled:
        reader = _SampleReader()
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                self._raise_for(response)
            try:
                for line in ndjson.lines(response.iter_bytes()):
                    reader.add(line)
            except httpx.TransportError as exc:  # the connection went mid-answer, or the read timed out
                raise reader.cut(f"{type(exc).__name__}: {exc}") from exc
        return reader.result()

    def _get(self, path: str, headers: dict[str, str] | None = None) -> Any:
        response = self._http.get(path, headers=headers)
        self._raise_for(response)
        return response.json()


class AsyncRolloutClient(_BaseClient):
    """Asynchronous client, same calls and keys as RolloutClient."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        key_file: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(url, api_key=api_key, admin_key=admin_key, key_file=key_file, timeout_s=timeout_s)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=timeout_s)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        response = await self._http.post("/groups", json=self._group_body(request, fields))
        self._raise_for(response)
        return GroupResult.model_validate_json(response.content)

    async def groups(self, requests: Iterable[GroupRequest | dict]) -> AsyncIterator[BatchItem]:
        async with self._http.stream("POST", "/groups/batch", json=self._batch_body(requests)) as response:
            if response.status_code >= 400:
                await response.aread()
                self._raise_for(response)
            async for line in ndjson.alines(response.aiter_bytes()):
                if line.strip():
                    yield self._parse_line(line)

    async def tasks(self) -> list[dict]:
        return (await self._get("/tasks"))["tasks"]

    async def health(self) -> dict:
        return self._health(await self._http.get("/health"))

    async def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> dict:
        started, pause = time.monotonic(), Backoff(poll_s, poll_s)
        while True:
            answer: dict | Exception
            try:
                answer = self._health(await self._http.get("/health", timeout=self._ask_timeout(started, timeout_s)))
            except _NOT_READY_YET as exc:
                answer = exc
            if self._ready_or_wait(answer, started, timeout_s):
                assert isinstance(answer, dict)
                return answer
            await pause.sleep()

    async def health_detail(self) -> dict:
        return await self._get("/health/detail")

    async def policy(self) -> PolicyState:
        return PolicyState.model_validate(await self._get("/policy"))

    async def update_policy(
        self, version: str, *, lora: str | None = None, weights: str | None = None
    ) -> PolicyUpdateResult:
        response = await self._http.post(
            "/policy", json=self._update_body(version, lora, weights), timeout=None, headers=self._admin_headers
        )
        self._raise_for(response)
        return PolicyUpdateResult.model_validate_json(response.content)

    async def pause_policy(self, timeout_s: float | None = None) -> PolicyState:
        response = await self._http.post("/policy/pause", json={"timeout_s": timeout_s}, headers=self._admin_headers)
        self._raise_for(response)
        return PolicyState.model_validate_json(response.content)

    async def envs(self) -> list[EnvState]:
        return [EnvState.model_validate(e) for e in await self._get("/envs", self._admin_headers)]

    async def add_env(self, url: str, *, timeout_s: float = 60.0) -> EnvState:
        body = self._body(EnvAdd, url=url, timeout_s=timeout_s)
        response = await self._http.post("/envs", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return EnvState.model_validate_json(response.content)

    async def drain_env(self, url: str) -> EnvState:
        response = await self._http.post("/envs/drain", json=self._body(EnvRef, url=url), headers=self._admin_headers)
        self._raise_for(response)
        return EnvState.model_validate_json(response.content)

    async def remove_env(self, url: str, *, timeout_s: float = 300.0) -> EnvRemoved:
        body = self._body(EnvRemove, url=url, timeout_s=timeout_s)
        response = await self._http.post("/envs/remove", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return EnvRemoved.model_validate_json(response.content)

    async def add_replica(
        self, url: str, *, role: str = "policy", timeout_s: float = 300.0, api_key_env: str | None = None
    ) -> ReplicaState:
        body = self._body(ReplicaAdd, url=url, role=role, timeout_s=timeout_s, api_key_env=api_key_env)
        response = await self._http.post("/replicas", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return ReplicaState.model_validate_json(response.content)

    async def drain_replica(self, url: str, *, role: str = "policy") -> ReplicaState:
        body = self._body(ReplicaRef, url=url, role=role)
        response = await self._http.post("/replicas/drain", json=body, headers=self._admin_headers)
        self._raise_for(response)
        return ReplicaState.model_validate_json(response.content)

    async def remove_replica(self, url: str, *, role: str = "policy", timeout_s: float = 300.0) -> ReplicaState:
        body = self._body(ReplicaRemove, url=url, role=role, timeout_s=timeout_s)
        response = await self._http.post("/replicas/remove", json=body, timeout=None, headers=self._admin_headers)
        self._raise_for(response)
        return ReplicaState.model_validate_json(response.content)

    async def sample(self, **fields: Any) -> Sampled:
        return await self._sampled("/groups/sample", self._body_json(SampleRequest, fields))

    async def open_stream(self, **fields: Any) -> StreamState:
        response = await self._http.post("/samplers", json=self._body_json(StreamCreate, fields))
        self._raise_for(response)
        return StreamState.model_validate_json(response.content)

    async def pull(self, stream_id: str, count: int, *, timeout_s: float = 3600) -> Sampled:
        body = self._body_json(StreamPull, {"count": count, "timeout_s": timeout_s})
        return await self._sampled(f"/samplers/{stream_id}/pull", body)

    async def stream_state(self, stream_id: str) -> StreamState:
        return StreamState.model_validate(await self._get(f"/samplers/{stream_id}"))

    async def close_stream(self, stream_id: str) -> StreamState:
        response = await self._http.delete(f"/samplers/{stream_id}")
        self._raise_for(response)
        return StreamState.model_validate_json(response.content)

    async def task_stats(self, task_ids: list[str] | None = None) -> list[TaskStats]:
        response = await self._http.get("/tasks/stats", params={"task_id": task_ids} if task_ids else None)
        self._raise_for(response)
        return [TaskStats.model_validate(t) for t in response.json()]

    async def _sampled(self, path: str, body: dict) -> Sampled:
        reader = _SampleReader()
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                self._raise_for(response)
            try:
                async for line in ndjson.alines(response.aiter_bytes()):
                    reader.add(line)
            except httpx.TransportError as exc:  # the connection went mid-answer, or the read timed out
                raise reader.cut(f"{type(exc).__name__}: {exc}") from exc
        return reader.result()

    async def _get(self, path: str, headers: dict[str, str] | None = None) -> Any:
        response = await self._http.get(path, headers=headers)
        self._raise_for(response)
        return response.json()
