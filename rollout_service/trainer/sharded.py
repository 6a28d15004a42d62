"""Several rollout services, each owning its own envs: every group goes to a service serving its task.

One service process drives ~800-2,600 exact turns a second, by completion length and machine load
(docs/benchmarks.md: "The service's own ceiling"); a run that needs more starts several, each with envs of its
own (`--env`, or `rollout-service ray` deployments in separate namespaces), and spreads its groups
with these clients. The task map comes
from each service's GET /tasks, asked on first use and again when a task is not found; a task that
several services serve goes to the one with the fewest of this client's groups in flight.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..protocol import GroupRequest, GroupResult, PolicyState, PolicyUpdateResult
from .client import AsyncRolloutClient, BatchItem, RequestRejected, RolloutError, ServiceUnavailable, _BaseClient

_CLOSE_WAIT_S = 30.0  # how long leaving `ShardedClient.groups` early waits for its streams to close


class _TaskMap:
    """Which services serve which task (by id, and by slug), and this client's groups in flight on each."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("give at least one service URL")
        self.urls = list(urls)
        self.by_id: dict[str, list[int]] | None = None
        self.by_slug: dict[str, list[int]] = {}
        self.unreachable: dict[str, str] = {}  # services whose /tasks failed at the last refresh
        self.in_flight = [0] * len(urls)

    def learn(self, listings: list[list[dict] | BaseException]) -> None:
        self.by_id, self.by_slug, self.unreachable = {}, {}, {}
        for index, tasks in enumerate(listings):
            if isinstance(tasks, BaseException):
                self.unreachable[self.urls[index]] = f"{type(tasks).__name__}: {tasks}"
                continue
            for task in tasks:
                if task.get("task_id"):
                    self.by_id.setdefault(task["task_id"], []).append(index)
                if task.get("slug"):
                    self.by_slug.setdefault(task["slug"], []).append(index)

    def pick(self, body: dict) -> int | None:
        """The service for this group (its slot in flight taken), or None if no known one serves it."""
        assert self.by_id is not None
        candidates = self.by_id.get(body["task_id"]) if body.get("task_id") else self.by_slug.get(body.get("slug", ""))
        if not candidates:
            return None
        index = min(candidates, key=lambda i: self.in_flight[i])
        self.in_flight[index] += 1
        return index

    def unknown(self, body: dict) -> RolloutError:
        name = f"task_id {body.get('task_id')!r}" if body.get("task_id") else f"slug {body.get('slug')!r}"
        if self.unreachable:
            down = "; ".join(f"{url}: {why}" for url, why in self.unreachable.items())
            return ServiceUnavailable(None, "unreachable", f"no service that answers serves {name} (down: {down})")
        return RequestRejected(404, "unknown_task", f"no service serves a task with {name} ({', '.join(self.urls)})")


class AsyncShardedClient:
    """`group()`, `groups()`, `update_policy()` and `pause_policy()` of AsyncRolloutClient over
    several services."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        key_file: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.map = _TaskMap(urls)
        self.clients = [
            AsyncRolloutClient(u, api_key=api_key, admin_key=admin_key, key_file=key_file, timeout_s=timeout_s)
            for u in urls
        ]

    async def __aenter__(self) -> AsyncShardedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def refresh(self) -> None:
        """Ask every service which tasks it serves (one that does not answer serves none for now)."""
        self.map.learn(list(await asyncio.gather(*(c.tasks() for c in self.clients), return_exceptions=True)))

    async def _route(self, body: dict) -> int:
        index = self.map.pick(body) if self.map.by_id is not None else None
        if index is None:
            await self.refresh()  # first use, or a task that moved or was added since
            index = self.map.pick(body)
        if index is None:
            raise self.map.unknown(body)
        return index

    async def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        body = _BaseClient._group_body(request, fields)
        index = await self._route(body)
        try:
            return await self.clients[index].group(body)
        finally:
            self.map.in_flight[index] -= 1

    async def groups(self, requests: Iterable[GroupRequest | dict]) -> AsyncIterator[BatchItem]:
        """Each group as soon as it finishes, `index` being its place in `requests`. One batch per
        service; leaving the loop early closes every stream (the services cancel those groups)."""
        shards: dict[int, tuple[list[int], list[dict]]] = {}
        try:
            for position, request in enumerate(requests):
                body = _BaseClient._batch_group_body(position, request)
                positions, bodies = shards.setdefault(await self._route(body), ([], []))
                positions.append(position)
                bodies.append(body)
        except BaseException:
            for index, (positions, _) in shards.items():
                self.map.in_flight[index] -= len(positions)
            raise
        items: asyncio.Queue[BatchItem | BaseException | None] = asyncio.Queue()

        async def pump(index: int, positions: list[int], bodies: list[dict]) -> None:
            left = len(bodies)
            try:
                async for item in self.clients[index].groups(bodies):
                    left -= 1
                    self.map.in_flight[index] -= 1
                    await items.put(BatchItem(positions[item.index], item.group, item.error))
            except Exception as exc:  # the whole shard failed (refused, unreachable): the caller hears it
                await items.put(exc)
            finally:
                self.map.in_flight[index] -= left
                await items.put(None)

        tasks = [asyncio.ensure_future(pump(i, *shard)) for i, shard in shards.items()]
        try:
            running = len(tasks)
            while running:
                item = await items.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def update_policy(
        self, version: str, *, lora: str | None = None, weights: str | None = None
    ) -> list[PolicyUpdateResult]:
        """The update on every service (each follows the policy of its own replicas), in order."""
        return [await c.update_policy(version, lora=lora, weights=weights) for c in self.clients]

    async def pause_policy(self) -> list[PolicyState]:
        return [await c.pause_policy() for c in self.clients]


class ShardedClient:
    """The same calls, synchronous. Batches stream on an event loop of this client's own (a thread
    while `groups()` runs), so leaving a loop early closes every stream at once."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        key_file: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.urls, self._key, self._admin_key, self._timeout_s = list(urls), api_key, admin_key, timeout_s
        self._key_file = key_file
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sharded-client", daemon=True)
        self._thread.start()
        self._async = self._run(self._make())

    async def _make(self) -> AsyncShardedClient:
        return AsyncShardedClient(
            self.urls, api_key=self._key, admin_key=self._admin_key, key_file=self._key_file, timeout_s=self._timeout_s
        )

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    @property
    def map(self) -> _TaskMap:
        return self._async.map

    def refresh(self) -> None:
        self._run(self._async.refresh())

    def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        return self._run(self._async.group(request, **fields))

    def groups(self, requests: Iterable[GroupRequest | dict]) -> Iterator[BatchItem]:
        items: queue.Queue[BatchItem | BaseException | None] = queue.Queue()
        stream = self._async.groups(list(requests))

        async def pump() -> None:
            try:
                async for item in stream:
                    items.put(item)
            except BaseException as exc:  # refused, unreachable, or cancelled by an early exit
                items.put(exc)
            finally:
                items.put(None)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        item: BatchItem | BaseException | None = None
        try:
            while (item := items.get()) is not None:
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        break
                    raise item
                yield item
        finally:
            task.cancel()  # an early exit: the streams close now, the services cancel what is left
            # That cancel returns at once and the streams close on the loop after it: the pump's last
            # word (None) says they have, so nothing of this batch is left pending when the caller goes on
            # (closing the client then would destroy it mid-close).
            # Not on the loop's own thread (a generator closed there, or collected), nor on a stopped loop:
            # the pump could not run while this waits.
            here = threading.current_thread() is self._thread or not self._loop.is_running()
            deadline = time.monotonic() + (0 if here else _CLOSE_WAIT_S)
            while item is not None and (left := deadline - time.monotonic()) > 0:
                try:
                    item = items.get(timeout=left)
                except queue.Empty:
                    break

    def update_policy(self, version: str, *, lora: str | None = None, weights: str | None = None) -> list:
        return self._run(self._async.update_policy(version, lora=lora, weights=weights))

    def pause_policy(self) -> list:
        return self._run(self._async.pause_policy())
