"""Several rollout services, each owning its own envs: every group goes to a service serving its task.

One service process drives a few hundred turns a second (README: "The service's own ceiling"); a
run that needs more starts several, each with envs of its own (`--env`, or `rollout-service ray`
deployments in separate namespaces), and spreads its groups with these clients. The task map comes
from each service's GET /tasks, asked on first use and again when a task is not found; a task that
several services serve goes to the one with the fewest of this client's groups in flight.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

from ..protocol import GroupRequest, GroupResult
from .client import AsyncRolloutClient, BatchItem, RequestRejected, RolloutClient, _BaseClient


class _TaskMap:
    """task_id and slug -> the indices of the services that serve it; in-flight groups per service."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("give at least one service URL")
        self.urls = list(urls)
        self.owners: dict[str, list[int]] | None = None
        self.in_flight = [0] * len(urls)

    def learn(self, listings: list[list[dict]]) -> None:
        owners: dict[str, list[int]] = {}
        for index, tasks in enumerate(listings):
            for task in tasks:
                for key in (task.get("task_id"), task.get("slug")):
                    if key:
                        owners.setdefault(key, []).append(index)
        self.owners = owners

    def pick(self, body: dict) -> int | None:
        """The service for this group, or None if no known service serves its task."""
        assert self.owners is not None
        candidates = self.owners.get(body.get("task_id") or body.get("slug") or "")
        if not candidates:
            return None
        return min(candidates, key=lambda i: self.in_flight[i])

    def unknown(self, body: dict) -> RequestRejected:
        name = f"task_id {body.get('task_id')!r}" if body.get("task_id") else f"slug {body.get('slug')!r}"
        return RequestRejected(404, "unknown_task", f"no service serves a task with {name} ({', '.join(self.urls)})")


class AsyncShardedClient:
    """`group()` and `groups()` of AsyncRolloutClient over several services."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, timeout_s: float | None = None) -> None:
        self.map = _TaskMap(urls)
        self.clients = [AsyncRolloutClient(u, api_key=api_key, timeout_s=timeout_s) for u in urls]

    async def __aenter__(self) -> AsyncShardedClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def refresh(self) -> None:
        self.map.learn(list(await asyncio.gather(*(c.tasks() for c in self.clients))))

    async def _route(self, body: dict) -> int:
        if self.map.owners is None or self.map.pick(body) is None:
            await self.refresh()  # first use, or a task that moved or was added since
        index = self.map.pick(body)
        if index is None:
            raise self.map.unknown(body)
        return index

    async def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        body = _BaseClient._group_body(request, fields)
        index = await self._route(body)
        self.map.in_flight[index] += 1
        try:
            return await self.clients[index].group(body)
        finally:
            self.map.in_flight[index] -= 1

    async def groups(self, requests: Iterable[GroupRequest | dict]) -> AsyncIterator[BatchItem]:
        """Each group as soon as it finishes, `index` being its place in `requests`. One batch per
        service; leaving the loop early closes every stream (the services cancel those groups)."""
        shards = await self._split(requests)
        items: asyncio.Queue[BatchItem | BaseException | None] = asyncio.Queue()

        async def pump(index: int, positions: list[int], bodies: list[dict]) -> None:
            self.map.in_flight[index] += len(bodies)
            try:
                async for item in self.clients[index].groups(bodies):
                    await items.put(BatchItem(positions[item.index], item.group, item.error))
            except Exception as exc:  # the whole shard failed (refused, unreachable): the caller hears it
                await items.put(exc)
            finally:
                self.map.in_flight[index] -= len(bodies)
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

    async def _split(self, requests: Iterable[GroupRequest | dict]) -> dict[int, tuple[list[int], list[dict]]]:
        shards: dict[int, tuple[list[int], list[dict]]] = {}
        for position, request in enumerate(requests):
            body = _BaseClient._group_body(request, {})
            index = await self._route(body)
            positions, bodies = shards.setdefault(index, ([], []))
            positions.append(position)
            bodies.append(body)
        return shards


class ShardedClient:
    """`group()` and `groups()` of RolloutClient over several services (one thread per service
    while a batch streams)."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, timeout_s: float | None = None) -> None:
        self.map = _TaskMap(urls)
        self._key, self._timeout_s = api_key, timeout_s
        self.clients = [RolloutClient(u, api_key=api_key, timeout_s=timeout_s) for u in urls]
        self._lock = threading.Lock()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def refresh(self) -> None:
        self.map.learn([c.tasks() for c in self.clients])

    def _route(self, body: dict) -> int:
        if self.map.owners is None or self.map.pick(body) is None:
            self.refresh()
        index = self.map.pick(body)
        if index is None:
            raise self.map.unknown(body)
        return index

    def group(self, request: GroupRequest | dict | None = None, **fields: Any) -> GroupResult:
        body = _BaseClient._group_body(request, fields)
        with self._lock:
            index = self._route(body)
            self.map.in_flight[index] += 1
        try:
            return self.clients[index].group(body)
        finally:
            with self._lock:
                self.map.in_flight[index] -= 1

    def groups(self, requests: Iterable[GroupRequest | dict]) -> Iterator[BatchItem]:
        """As AsyncShardedClient.groups. Each shard streams on a client of its own, closed when the
        caller leaves the loop (the services see the disconnect and cancel those groups)."""
        shards: dict[int, tuple[list[int], list[dict]]] = {}
        with self._lock:
            for position, request in enumerate(requests):
                body = _BaseClient._group_body(request, {})
                positions, bodies = shards.setdefault(self._route(body), ([], []))
                positions.append(position)
                bodies.append(body)
        items: queue.Queue[BatchItem | BaseException | None] = queue.Queue()
        streams = {i: RolloutClient(self.map.urls[i], api_key=self._key, timeout_s=self._timeout_s) for i in shards}

        def pump(index: int, positions: list[int], bodies: list[dict]) -> None:
            try:
                for item in streams[index].groups(bodies):
                    items.put(BatchItem(positions[item.index], item.group, item.error))
            except Exception as exc:
                items.put(exc)
            finally:
                items.put(None)

        threads = [threading.Thread(target=pump, args=(i, *shard), daemon=True) for i, shard in shards.items()]
        for thread in threads:
            thread.start()
        try:
            running = len(threads)
            while running:
                item = items.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for stream in streams.values():
                stream.close()  # a pump still reading gets an error and ends
            for thread in threads:
                thread.join(30)
