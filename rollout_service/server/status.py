"""/health and /health/detail: the service's status and what it is from the last probes, without
asking any backend now."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..protocol import PolicyState
from .groups.admission import Admission
from .groups.run_log import RunLog
from .groups.runner import GroupRunner
from .lifecycle import Lifecycle
from .membership.envs import EnvRegistry
from .membership.monitor import BackendMonitor
from .membership.replicas import ReplicaRegistry, token_prompts
from .membership.world_scheduler import WorldScheduler
from .policy.replica_states import Phase


class _Probed(BaseModel):
    """What the background monitor found at its last probe (absent keys: not probed yet)."""

    model_config = ConfigDict(extra="forbid")

    ok: bool | None = None
    error: str | None = None
    checked_at: float | None = None


class EnvDetail(_Probed):
    url: str
    pool: int
    held: int
    max_held: int
    draining: bool
    side: str | None  # the env's declared side (eval, train), if it declares one
    busy_world_seconds: float
    status: str | None = None  # the env's own word at the last probe
    leased: int | None = None  # the worlds the env itself counts as in use, where its /health says (refenv does)


class KvBound(BaseModel):
    cap: int | None = Field(description="turns in flight it may have; null: no bound (see why)")
    in_flight: int
    waiting: int = Field(description="turns waiting in the service for a place under the cap")
    why: str = Field(description="how the cap was chosen at the last read of its /metrics")


class ModelDetail(_Probed):
    url: str
    role: str
    model: str
    outstanding: int
    episodes: int = Field(0, description="episodes in flight pinned here (new episodes go to the fewest)")
    kv_admission: KvBound | None = Field(None, description="the bound on its turns in flight (KV-aware admission)")
    state: str = Field(description="where it stands: joining, serving, restoring, paused, excluded, draining")
    token_prompts: str
    out_of_routing: str | None = None
    last_error: str | None = None


class RunLogDetail(BaseModel):
    path: str
    groups_written: int
    groups_lost: int
    error: str | None


class HealthDetail(BaseModel):
    """GET /health/detail. While starting, only status, reasons, waiting_for, startup_timeout_s,
    run_id and uptime_s are set; the answer leaves out what is not set."""

    status: str
    reasons: list[str]
    run_id: str
    uptime_s: float
    waiting_for: dict[str, str] | None = None
    startup_timeout_s: float | None = None
    run_log: RunLogDetail | None = None
    groups_in_flight: int | None = None
    attempts_queued: int | None = None
    attempts_waiting_for_a_world: int | None = None
    episodes_ending: int | None = None
    envs: list[EnvDetail] | None = None
    models: list[ModelDetail] | None = None
    policy: PolicyState | None = None
    warnings: list[str] | None = None  # how the service runs unsafely (--insecure-no-auth), for as long as it does


class Health:
    def __init__(
        self,
        lifecycle: Lifecycle,
        envs: EnvRegistry,
        replicas: ReplicaRegistry,
        admission: Admission,
        parts: tuple[WorldScheduler, GroupRunner, BackendMonitor],
        run_log: RunLog | None,
        run_id: str,
    ) -> None:
        self.lifecycle, self.envs, self.replicas, self.admission = lifecycle, envs, replicas, admission
        self.scheduler, self.runner, self.monitor = parts
        self.run_log, self.run_id = run_log, run_id

    def status(self) -> str:
        """ok, or degraded: from the last probes and the run log, without asking anyone now."""
        if not self.lifecycle.ready:
            return "failed" if self.lifecycle.startup_failure else "starting"
        ok = self.monitor.all_ok() and (self.run_log is None or self.run_log.error is None)
        policy = self.replicas.states["policy"]
        routed = all(policy.phase(e) in (Phase.SERVING, Phase.DRAINING) for e in self.replicas.policy.client.endpoints)
        paused = self.replicas.versions.paused
        return "ok" if ok and routed and not paused and not self.envs.unserved(first_only=True) else "degraded"

    def detail(self) -> HealthDetail:
        lifecycle = self.lifecycle
        uptime_s = round(time.time() - lifecycle.started_at, 1)
        if not lifecycle.ready:
            return HealthDetail(
                status=self.status(),
                reasons=[lifecycle.starting_summary()],
                waiting_for=dict(lifecycle.waiting_for),
                startup_timeout_s=lifecycle.startup_timeout_s,
                run_id=self.run_id,
                uptime_s=uptime_s,
            )
        envs = [
            EnvDetail(
                url=env.url,
                pool=env.slots.pool,
                held=env.slots.held,
                max_held=env.slots.max_held,
                draining=env.slots.draining,
                side=env.contract.side,
                busy_world_seconds=round(env.slots.busy_seconds, 3),
                **self.monitor.env_state(env.url),
            )
            for env in self.envs.envs.values()
        ]
        models = []
        for role, route in self.replicas.model_routes():
            episodes = route.client.episodes_on()
            for endpoint in route.client.endpoints:
                standing = self.replicas.states[role].report(endpoint)
                state: dict[str, Any] = {
                    "url": endpoint.url,
                    "role": role,
                    "model": route.model,
                    "outstanding": endpoint.outstanding,
                    "episodes": episodes.get(endpoint.url, 0),
                    "kv_admission": route.client.kv.gate(endpoint.url).report(),
                    "state": standing.state,
                    "token_prompts": "no: support turns go as chat" if role == "support" else token_prompts(route),
                }
                if not standing.routed:
                    state["out_of_routing"] = standing.reason
                state.update(self.monitor.model_state(role, endpoint.url))
                if endpoint.last_error:
                    state["last_error"] = endpoint.last_error[:300]
                models.append(ModelDetail(**state))
        run_log = None
        if self.run_log is not None:
            run_log = RunLogDetail(
                path=str(self.run_log.path),
                groups_written=self.run_log.groups_written,
                groups_lost=self.run_log.groups_lost,
                error=self.run_log.error,
            )
        reasons = [f"env {e.url}: {e.error}" for e in envs if not e.ok]
        reasons += [f"model server {m.url}: {m.error}" for m in models if not m.ok]
        reasons += [f"model server {m.url}: {m.out_of_routing}" for m in models if m.out_of_routing]
        versions = self.replicas.versions
        if versions.paused_since is not None:
            held = time.time() - versions.paused_since
            reasons.append(f"policy replicas held paused by POST /policy/pause for {held:.0f}s: no turn starts")
        if run_log and run_log.error:
            reasons.append(f"run log: {run_log.error}")
        reasons += self.envs.unserved()
        return HealthDetail(
            status=self.status(),
            reasons=reasons,
            run_id=self.run_id,
            run_log=run_log,
            uptime_s=uptime_s,
            groups_in_flight=len(self.admission.running),
            attempts_queued=self.admission.queued_attempts,
            attempts_waiting_for_a_world=self.scheduler.waiting,
            episodes_ending=self.runner.episodes_ending,
            envs=envs,
            models=models,
            policy=versions.state(),  # sets every field: the route's exclude_unset leaves none out
        )
