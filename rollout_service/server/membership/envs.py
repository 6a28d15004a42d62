"""The env registry: the env servers scheduled on, the tasks they serve, and their membership.

Envs are found at start (`discover`) or added, drained and removed while groups run. An env is
refused if its rewards are not comparable with those of an env serving the same task, or if it is
an env present already under another name (one server scheduled twice would hold twice its worlds).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
from dataclasses import dataclass

import yarl

from ...backends.env_client import (
    BadEnvAnswer,
    EnvAddressRefused,
    EnvClient,
    EnvError,
    EnvHealth,
    EnvTask,
    EnvUnreachable,
)
from ...protocol import EnvAdd, EnvContract, EnvRef, EnvRemove, EnvRemoved, EnvState
from ..errors import BackendTimedOut, Conflict, IncomparableEnv, Invalid, NotFound, StartupError, shutting_down
from ..lifecycle import Lifecycle, NotYet, ask_until_ready
from ..metrics import Metrics
from .allowed_backends import AllowedBackends
from .targets import EnvHandle, TaskTarget
from .world_scheduler import EnvSlots, WorldScheduler

log = logging.getLogger("rollout_service.envs")

ServerKeys = frozenset[tuple[str, int, str]]


@dataclass
class Discovered:
    url: str
    health: EnvHealth
    tasks: list[EnvTask]


class EnvRegistry:
    def __init__(
        self,
        lifecycle: Lifecycle,
        scheduler: WorldScheduler,
        metrics: Metrics,
        allowed: AllowedBackends,
        *,
        max_answer_bytes: int,
        env_token: str | None = None,
    ) -> None:
        self.lifecycle = lifecycle
        self.scheduler = scheduler  # envs found at start join it once start-up has put them in order
        self.max_answer_bytes = max_answer_bytes  # of an added env's answers, its probe's included
        self.metrics = metrics
        self.allowed = allowed  # what POST /envs may reach
        self.env_token = env_token  # sent to every env added at runtime too (refenv --token)
        self.envs: dict[str, EnvHandle] = {}
        self.targets: dict[str, TaskTarget] = {}
        self.by_slug: dict[str, str] = {}
        self.task_info: dict[str, EnvTask] = {}
        self.adding: set[str] = set()  # envs being added (POST /envs), not yet scheduled
        # Where each env's URL connects (see server_addresses): one server under two names would be
        # scheduled as two pools, holding twice its worlds.
        self.addresses: dict[str, ServerKeys] = {}

    # -- found at start -----------------------------------------------------------------------

    async def discover(self, url: str, client: EnvClient) -> None:
        """Wait for the env at `url`, check it, and add it with its tasks (refusing at once an env
        whose rewards are not comparable with an env found before it, whatever else is awaited)."""
        found = await self.lifecycle.until_ready(f"env {url}", functools.partial(ask_env, url, client))
        addresses = await server_addresses(url)
        env = checked_env(found, client)
        self.refuse_incomparable(env, found.tasks)
        if other := self.same_server(url, addresses):
            raise StartupError(f"{other}: give each env once")
        self.addresses[url] = addresses
        self.envs[url] = env
        self.index_tasks(env, found.tasks)

    def schedule_in_given_order(self, given: list[str]) -> None:
        """Found in the order they answered; kept, and scheduled, in the order they were given."""
        order = {url: i for i, url in enumerate(given)}
        ordered = sorted(self.envs.items(), key=lambda item: order[item[0]])
        self.envs.clear()  # the same dict: the monitor reads it
        self.envs.update(ordered)
        for target in self.targets.values():
            target.envs.sort(key=lambda env: order[env.url])
            target.contract = target.envs[0].contract
        for env in self.envs.values():
            self.scheduler.add_env(env.slots)

    def same_server(self, url: str, addresses: ServerKeys) -> str | None:
        """Why `url` is an env scheduled already under another name, or None."""
        for other, known in self.addresses.items():
            if other != url and (shared := addresses & known):
                host, port, path = min(shared)
                return f"env {url} is env {other} under another name (both reach {host}:{port}{path})"
        return None

    def refuse_incomparable(self, env: EnvHandle, tasks: list[EnvTask]) -> None:
        """IncomparableEnv if a task of `env` is served already with another dataset or reward version,
        or its slug names another task already."""
        for task in tasks:
            named = self.by_slug.get(task.slug) if task.slug else None
            if named is not None and named != task.task_id:
                raise IncomparableEnv(
                    f"env {env.url} names task {task.task_id} {task.slug!r}, the slug of task {named} served "
                    f"by {', '.join(e.url for e in self.targets[named].envs)}: a slug must name one task"
                )
            target = self.targets.get(task.task_id)
            if target is None:
                continue
            first = target.contract
            if (first.catalog_hash, first.reward_version) != (env.contract.catalog_hash, env.contract.reward_version):
                raise IncomparableEnv(
                    f"task {task.task_id} is served by {target.envs[0].url if target.envs else first.urls[0]} "
                    f"(dataset {first.catalog_hash}, reward {first.reward_version}) and by {env.url} "
                    f"(dataset {env.contract.catalog_hash}, reward {env.contract.reward_version}): their rewards "
                    "are not comparable; serve one dataset and reward version per service"
                )

    def index_tasks(self, env: EnvHandle, tasks: list[EnvTask]) -> None:
        for task in tasks:
            target = self.targets.get(task.task_id)
            self.task_info.setdefault(task.task_id, task)
            if target is None:
                self.targets[task.task_id] = TaskTarget(task.task_id, task.slug, [env])
                if task.slug:
                    self.by_slug[task.slug] = task.task_id
            elif env not in target.envs:  # a task listed twice is served once
                target.envs.append(env)

    # -- membership: envs added, drained and removed while groups run ---------------------------

    async def add(self, body: EnvAdd) -> EnvState:
        """Schedule on one more env: it must answer ready within `timeout_s`, speak the step
        contract and, for every task it shares with the envs present, have their dataset and reward
        version. Queued attempts of its tasks may take its worlds at once."""
        self.lifecycle.refuse_unless_ready()
        url = body.url
        await self.allowed.check(url, "env")  # before anything is asked of it
        if url in self.envs or url in self.adding:
            draining = url in self.envs and self.envs[url].slots.draining
            state = "is draining: remove it first" if draining else "is scheduled already (or being added)"
            raise Conflict("env_present", f"env {url} {state}")
        self.adding.add(url)
        client = EnvClient(
            url, max_answer_bytes=self.max_answer_bytes, token=self.env_token, address_policy=self.allowed
        )
        try:
            try:
                found = await asyncio.wait_for(ask_until_ready(functools.partial(ask_env, url, client)), body.timeout_s)
                addresses = await server_addresses(url)
                # No await from here to its scheduling: the checks hold against envs added meanwhile.
                env = checked_env(found, client)
                self.refuse_incomparable(env, found.tasks)
            except TimeoutError:
                raise BackendTimedOut(
                    "env_not_ready", f"env {url} did not answer ready within timeout_s={body.timeout_s:g}"
                ) from None
            except IncomparableEnv as exc:
                raise Conflict("env_incomparable", str(exc)) from None
            except StartupError as exc:
                raise Invalid("env_refused", str(exc)) from None
            if self.lifecycle.closing:
                raise shutting_down()
            if other := self.same_server(url, addresses):
                raise Conflict("env_present", f"{other}: its pool would be held twice")
        except BaseException:
            self.adding.discard(url)
            await client.aclose()
            raise
        self.adding.discard(url)
        self.addresses[url] = addresses
        self.envs[url] = env
        self.index_tasks(env, found.tasks)
        serves = {(t.task_id, True) for t in found.tasks}
        if env.contract.side != "eval":
            serves |= {(t.task_id, False) for t in found.tasks}
        self.scheduler.add_env(env.slots, serves)
        log.info("env %s added: pool %d, %d tasks", url, env.slots.pool, len(found.tasks))
        return self.state(env)

    def drain(self, body: EnvRef) -> EnvState:
        """No new episode on this env; the ones on it finish. Attempts queued for it alone wait for
        another env of their task (added later) or fail as env_no_world when it is removed."""
        env = self._present(body.url)
        slots = self.scheduler.drain_env(env.url)
        log.info("env %s draining: no new episode starts on it; %d still run", env.url, slots.held)
        return self.state(env)

    async def remove(self, body: EnvRemove) -> EnvRemoved:
        """Drain the env, wait (up to `timeout_s`) until no episode holds a world on it, then forget
        it. Episodes are never cut short: if some still run at the deadline the env stays draining
        and the answer is 409 env_busy with how many."""
        env = self._present(body.url)
        slots = self.scheduler.drain_env(env.url)
        assert slots.emptied is not None
        if slots.held:
            try:
                await asyncio.wait_for(slots.emptied.wait(), body.timeout_s)
            except TimeoutError:
                raise Conflict(
                    "env_busy",
                    f"{slots.held} episodes still run on env {env.url} after timeout_s={body.timeout_s:g}; it stays "
                    "draining (no new episode starts on it): remove it again later",
                ) from None
        if self.envs.get(env.url) is not env:  # removed by a concurrent call meanwhile
            raise NotFound("unknown_env", f"env {env.url} was removed meanwhile")
        self.scheduler.remove_env(env.url)
        del self.envs[env.url]
        self.addresses.pop(env.url, None)
        self.metrics.forget_env(env.url)
        gone = []
        for task_id, target in list(self.targets.items()):
            if env in target.envs:
                target.envs.remove(env)
                if not target.envs:
                    gone.append(task_id)
                    del self.targets[task_id]
                    self.task_info.pop(task_id, None)
                    if self.by_slug.get(target.slug) == task_id:
                        del self.by_slug[target.slug]
        await env.client.aclose()
        log.info("env %s removed; tasks no longer served: %d", env.url, len(gone))
        return EnvRemoved(url=env.url, tasks_no_longer_served=gone)

    def _present(self, url: str) -> EnvHandle:
        self.lifecycle.refuse_unless_ready()
        env = self.envs.get(url)
        if env is None:
            known = ", ".join(self.envs) or "none"
            raise NotFound("unknown_env", f"no env {url} is scheduled here; present: {known}")
        return env

    # -- what is served ---------------------------------------------------------------------------

    def state(self, env: EnvHandle) -> EnvState:
        return EnvState(
            url=env.url,
            pool=env.slots.pool,
            held=env.slots.held,
            draining=env.slots.draining,
            side=env.contract.side,
            catalog_hash=env.contract.catalog_hash,
            reward_version=env.contract.reward_version,
            tasks=sum(env in t.envs for t in self.targets.values()),
        )

    def task_list(self) -> list[dict]:
        return [{"task_id": t.task_id, "slug": t.slug, "envs": [e.url for e in t.envs]} for t in self.targets.values()]

    def unserved(self, first_only: bool = False) -> list[str]:
        """What the envs present cannot serve: nothing at all, or tasks whose every env drains, or every
        training-side one (their queued attempts wait for an env added for them, or end when the
        drained one is removed). `first_only`: stop at the first such task (status() asks often)."""
        if not self.envs:
            return ["no env: every env was removed (POST /envs adds one)"]
        if not any(env.slots.draining for env in self.envs.values()):
            return []
        stranded = []
        for target in self.targets.values():
            # As resolve() refuses groups: with eval-side envs, or (a task some training env serves)
            # without them.
            if target.drained(include_eval=True) or (target.candidates(False) and target.drained(False)):
                stranded.append(target.task_id)
                if first_only:
                    break
        if not stranded:
            return []
        named = ", ".join(stranded[:5]) + (f" and {len(stranded) - 5} more" if len(stranded) > 5 else "")
        return [
            f"tasks served only by draining envs (all, or all on the training side): {named}. Their queued "
            "attempts wait until an env serving them is added (POST /envs) or end as env_no_world when the "
            "drained env is removed; new groups for them get 503 envs_draining"
        ]

    async def aclose(self) -> None:
        for env in list(self.envs.values()):  # a removal finishing meanwhile changes the dict
            await env.client.aclose()


async def ask_env(url: str, client: EnvClient) -> Discovered:
    """The env's health and tasks, or NotYet while it is not up (or not ready) yet."""
    try:
        # One question at a time: wait_for cancels the one in flight, so nothing is left asking a
        # slow env behind the next try.
        health = await client.health()
        if health.status != "ready":
            raise NotYet(f"status {health.status!r}, not 'ready'")
        refuse_unless_step(url, health)
        client.accept()  # an env by its /health: the rest is asked with the env's token
        tasks = await client.tasks()
    except EnvError as exc:
        if isinstance(exc, EnvAddressRefused):  # waiting would not change where its name points now
            raise StartupError(f"env {url}: {exc.message}") from None
        if isinstance(exc, EnvUnreachable):
            raise NotYet(f"unreachable ({exc.message or exc})") from None
        if (exc.status or 0) >= 500:
            raise NotYet(str(exc)) from None
        # By its status and the contract's kind only: echoing what it said would let whoever adds an
        # env read any page the service can reach. (A BadEnvAnswer's message is the service's own words
        # on the answer's shape.)
        said = f": {exc.message}" if isinstance(exc, BadEnvAnswer) else ""
        answered = f"it answered {exc.status}" if exc.status is not None else "its answer was refused"
        raise StartupError(f"env {url} does not speak the step contract: {answered} ({exc.kind}){said}") from None
    return Discovered(url, health, tasks)


def runs_agents(health: EnvHealth) -> bool:
    """An agent server: its drive modes list "agent" (docs/agents.md); it is driven by POST /run."""
    drive_modes = health.capabilities.get("drive_modes")
    return isinstance(drive_modes, list) and "agent" in drive_modes


def refuse_unless_step(url: str, health: EnvHealth) -> None:
    drive_modes = health.capabilities.get("drive_modes")
    if drive_modes is not None and "step" not in drive_modes and not runs_agents(health):
        # Not its words (see ask_env): the modes it lists lack step.
        raise StartupError(
            f"env {url} does not serve step mode (its drive_modes lack 'step' and 'agent'): start it with --step"
        )


def checked_env(found: Discovered, client: EnvClient) -> EnvHandle:
    """The env as the scheduler and runner see it, or StartupError if it cannot serve episodes."""
    refuse_unless_step(found.url, found.health)
    client.agent = runs_agents(found.health)
    if not found.tasks:
        raise StartupError(f"env {found.url} serves no task")
    contract = EnvContract(
        urls=[found.url],
        catalog_hash=found.health.catalog_hash,
        data_anchor=found.health.dataset.get("data_anchor"),
        reward_version=found.health.reward_version,
        reward_profile=found.health.reward_profile,
        side=found.health.side,
    )
    return EnvHandle(found.url, client, EnvSlots(found.url, found.health.pool), contract)


async def server_addresses(url: str, timeout_s: float = 10.0) -> ServerKeys:
    """What identifies the server `url` reaches, as (host, port, path) keys: two URLs that share a key
    are one server. An IP address (however spelled: 127.1, 0x7f.0.0.1) or a name of this host's
    loopback (localhost) is keyed by the addresses it resolves to, so localhost and 127.0.0.1 share
    one. Any other name is keyed by itself: two names on one address may be two servers behind one
    proxy (virtual hosts, an ingress). Where the host does not resolve in time, by itself too."""
    parsed = yarl.URL(url)  # as the transport reads it (aiohttp's URL type)
    host, port, path = (parsed.host or "").lower(), parsed.port or 80, parsed.path.rstrip("/")
    by_name = frozenset({(host, port, path)})
    loop = asyncio.get_running_loop()
    try:
        found = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
    except (OSError, UnicodeError, TimeoutError):
        return by_name
    # A client connecting to the unspecified address reaches this host's loopback.
    unspecified = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    addresses = {unspecified.get(str(info[4][0]), str(info[4][0])) for info in found}
    loopback = all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)
    if not (loopback or _ip_literal(host)):
        return by_name
    return frozenset((address, port, path) for address in addresses)


def _ip_literal(host: str) -> bool:
    """An IP address, in any spelling the resolver takes (IPv6, 127.1, 0x7f.0.0.1, 2130706433)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        socket.inet_aton(host)
        return True
    except OSError:
        return False
