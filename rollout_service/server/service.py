"""The composition root: the service's rooms, wired together, started and stopped.

Each feature has its folder: membership/ (the envs, the model servers, the scheduler of env worlds,
the backend monitor), policy/ (versions, updates, pauses), groups/ (admission, the runner, attempts,
trajectories), sampler/ (streams and task statistics); status.py reads them for /health. This object
makes every part once, starts them in order and closes them in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ..backends.env_client import EnvClient
from .agents.lane import AgentLane
from .config import ServiceConfig
from .errors import StartupError
from .groups.admission import Admission, AdmissionLimits
from .groups.attempt import RunnerConfig
from .groups.run_log import RunLog
from .groups.runner import GroupRunner
from .lifecycle import Lifecycle
from .membership.allowed_backends import AllowedBackends
from .membership.envs import EnvRegistry
from .membership.monitor import BackendMonitor
from .membership.replicas import ReplicaRegistry
from .membership.world_scheduler import WorldScheduler
from .metrics import Metrics
from .sampler.caps import StreamCaps
from .sampler.streams import SamplerStreams
from .sampler.task_stats import TaskStatsBook
from .status import Health
from .task_sets import all_or_none

log = logging.getLogger("rollout_service.service")


class RolloutService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.run_id = config.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.lifecycle = Lifecycle(config.startup_timeout)
        # What membership may add: --allow-backends, and the hosts of the backends given at start.
        # Held at every connection to any backend, not only when one is added (see allowed_backends.py).
        self.allowed = allowed = AllowedBackends(
            config.allow_backends,
            [*config.env, *config.vllm, *config.support_vllm, *(spec.url for spec in config.model_endpoint)],
        )
        # Every part is made here, once; start() only waits for the backends and puts the envs found
        # in the scheduler. A request before then is refused by the lifecycle (503 starting).
        self.scheduler = WorldScheduler([])
        self.envs = EnvRegistry(
            self.lifecycle,
            self.scheduler,
            self.metrics,
            allowed,
            max_answer_bytes=config.max_answer_bytes,
            env_token=config.env_token(),
        )
        self.replicas = ReplicaRegistry(config, self.lifecycle, self.metrics, allowed)
        self.metrics.watch_replicas(self.replicas.load_rows)
        self.agents = AgentLane(config)  # tries on agent servers, and their model endpoint's tokens
        self.runner = GroupRunner(
            self.scheduler,
            self.replicas.policy,
            self.replicas.support,
            self.metrics,
            RunnerConfig(policy_stages=frozenset(config.policy_stage), max_staleness=config.max_staleness),
            self.replicas.versions,
            self.agents,
        )
        self.monitor = BackendMonitor(self.envs.envs, self.replicas.model_routes(), self.replicas.versions)
        self.run_log = RunLog(Path(config.runs_dir), self.run_id, config.max_run_log_queue) if config.runs_dir else None
        self.admission = Admission(
            AdmissionLimits(config.max_n, config.max_batch, config.max_queued_attempts),
            self.lifecycle,
            self.envs,
            self.replicas,
            self.runner,
            self.metrics,
            self.run_id,
            self.run_log,
        )
        self.health = Health(
            self.lifecycle,
            self.envs,
            self.replicas,
            self.admission,
            (self.scheduler, self.runner, self.monitor),
            self.run_log,
            self.run_id,
        )
        # The sampler's rooms: difficulty per task and version (fed by every group), and the streams.
        self.task_stats = TaskStatsBook(self.replicas.versions, self.metrics)
        self.admission.on_result = self.task_stats.record
        caps = StreamCaps(config.max_sampler_streams, config.max_sampler_streams_per_key, config.max_sampler_buffer)
        self.samplers = SamplerStreams(
            self.envs, self.admission, self.replicas.versions, self.task_stats, self.metrics, self.lifecycle, caps
        )

    async def start(self, say: Callable[[str], None] = log.info) -> None:
        """Wait for every env and model server to answer, then check that they fit together.

        An env or model server that does not answer yet, answers 5xx or says it is not ready is asked
        again with backoff, up to --startup-timeout, and `say` is told every few seconds what is still
        awaited. What waiting cannot fix (a wrong model name, an env that does not speak the step
        contract, datasets that disagree) is refused at once."""
        lifecycle = self.lifecycle
        clients = {
            url: EnvClient(
                url,
                max_answer_bytes=self.config.max_answer_bytes,
                token=self.config.env_token(),
                address_policy=self.allowed,
            )
            for url in self.config.env
        }
        lifecycle.waiting_for = {f"env {url}": "not asked yet" for url in clients}
        self.replicas.await_all()
        reporter = asyncio.ensure_future(lifecycle.report_waiting(say))
        try:
            await asyncio.wait_for(
                all_or_none([self.replicas.check(), *(self.envs.discover(url, c) for url, c in clients.items())]),
                self.config.startup_timeout,
            )
        except BaseException as exc:
            for c in clients.values():
                await c.aclose()
            if isinstance(exc, TimeoutError):
                raise StartupError(
                    f"still waiting after {self.config.startup_timeout:g}s (--startup-timeout) for "
                    f"{lifecycle.awaited()}"
                ) from None
            raise
        finally:
            reporter.cancel()
        if lifecycle.waiting_reported:
            say(f"every env and model server answered after {time.time() - lifecycle.started_at:.0f}s")
        self.envs.schedule_in_given_order(self.config.env)
        await self.replicas.probe_token_prompts()
        await self.replicas.versions.start()
        if self.run_log is not None:
            self.run_log.start()
        self.monitor.start()
        lifecycle.ready = True  # last: the service serves from here on
        log.info("started: %d envs, %d tasks, run %s", len(self.envs.envs), len(self.envs.targets), self.run_id)

    def cancel_running(self) -> None:
        """Shutting down: refuse new groups, cancel every running one; their episodes are abandoned on
        the way out. Called as the server's shutdown begins and again by close: said once."""
        if not self.lifecycle.closing:
            log.info("shutting down: cancelling %d running groups", len(self.admission.running))
        self.lifecycle.closing = True
        self.replicas.versions.begin_close()  # a replica that joins from now on gets no restore started
        self.admission.cancel_all()

    async def close(self) -> None:
        self.cancel_running()
        await self.samplers.close()  # streams end, their buffers are released
        if self.admission.running:
            await asyncio.wait(set(self.admission.running), timeout=30)
        await self.runner.drain(timeout_s=30)  # abandons still on their way to the envs
        await self.monitor.stop()
        await self.replicas.aclose()
        if self.run_log is not None:
            await self.run_log.close()
        await self.envs.aclose()
