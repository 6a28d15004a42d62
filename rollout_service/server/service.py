"""The composition root: the service's rooms, wired together, started and stopped.

Each concern lives in its own module: the env registry (envs.py), the model routes and replicas
(replicas.py), admission of groups (admission.py), start-up (startup.py) and health
(health_detail.py). This object builds them, starts them in order and closes them in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from .admission import Admission
from .attempt import RunnerConfig
from .backend_address import AllowedBackends
from .config import ServiceConfig
from .env_client import EnvClient
from .envs import EnvRegistry
from .errors import StartupError
from .health import BackendMonitor
from .health_detail import Health
from .metrics import Metrics
from .replicas import ReplicaRegistry
from .runlog import RunLog
from .runner import GroupRunner
from .sampler_streams import SamplerStreams
from .scheduler import WorldScheduler
from .startup import Lifecycle
from .stream_caps import StreamCaps
from .task_stats import TaskStatsBook
from .tasks import all_or_none

log = logging.getLogger("rollout_service.service")


class RolloutService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.run_id = config.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.lifecycle = Lifecycle(config.startup_timeout)
        # What membership may add: --allow-backends, and the hosts of the backends given at start.
        # Held at every connection to any backend, not only when one is added (see backend_address.py).
        self.allowed = allowed = AllowedBackends(
            config.allow_backends,
            [*config.env, *config.vllm, *config.support_vllm, *(spec.url for spec in config.model_endpoint)],
        )
        self.envs = EnvRegistry(
            self.lifecycle,
            self.metrics,
            allowed,
            max_answer_bytes=config.max_answer_bytes,
            env_token=config.env_token(),
        )
        self.replicas = ReplicaRegistry(config, self.lifecycle, self.metrics, allowed)
        self.run_log = RunLog(Path(config.runs_dir), self.run_id, config.max_run_log_queue) if config.runs_dir else None
        self.admission = Admission(
            config, self.lifecycle, self.envs, self.replicas, self.metrics, self.run_id, self.run_log
        )
        self.health = Health(self.lifecycle, self.envs, self.replicas, self.admission, self.run_log, self.run_id)
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
        self.envs.keep_given_order(self.config.env)
        await self.replicas.probe_token_prompts()
        await self.replicas.versions.start()
        if self.run_log is not None:
            self.run_log.start()
        scheduler = WorldScheduler([env.slots for env in self.envs.envs.values()])
        lifecycle.scheduler = scheduler
        lifecycle.runner = GroupRunner(
            scheduler,
            self.replicas.policy,
            self.replicas.support,
            self.metrics,
            RunnerConfig(policy_stages=frozenset(self.config.policy_stage), max_staleness=self.config.max_staleness),
            self.replicas.versions,
        )
        monitor = BackendMonitor(self.envs.envs, self.replicas.model_routes(), self.replicas.versions)
        monitor.start()
        lifecycle.monitor = monitor  # last: the service is ready from here on
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
        if self.lifecycle.runner is not None:
            await self.lifecycle.runner.drain(timeout_s=30)  # abandons still on their way to the envs
        if self.lifecycle.monitor is not None:
            await self.lifecycle.monitor.stop()
        await self.replicas.aclose()
        if self.run_log is not None:
            await self.run_log.close()
        await self.envs.aclose()
