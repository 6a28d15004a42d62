"""Prometheus metrics of one service instance (its own registry, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..protocol import Attempt, GroupResult

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


# How a trajectory went on from one turn to the next (groups/trajectory.py), counted by kind.
Continuation = Literal["from_samples", "from_reply", "rendered_apart", "appended"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.groups = Counter("rollout_groups", "Groups finished", ["outcome"], registry=r)
        self.attempts = Counter("rollout_attempts", "Episode tries finished, by status", ["status"], registry=r)
        self.episodes_in_flight = Gauge("rollout_episodes_in_flight", "Episodes held on each env", ["env"], registry=r)
        self.groups_in_flight = Gauge("rollout_groups_in_flight", "Groups running", registry=r)
        self.tokens = Counter("rollout_tokens", "Tokens through the model servers", ["kind"], registry=r)
        # Resolved once: a labels() lookup per turn shows in the hot path's profile.
        self._prompt_tokens = self.tokens.labels(kind="prompt")
        self._completion_tokens = self.tokens.labels(kind="completion")
        self.group_latency = Histogram(
            "rollout_group_latency_seconds", "Wall time of a group", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inference_latency = Histogram(
            "rollout_inference_latency_seconds", "One chat completion", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.phase = Histogram(
            "rollout_attempt_phase_seconds",
            "Time of an episode try by phase",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rewards = Histogram(
            "rollout_reward", "Scored rewards", buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1), registry=r
        )

        self.continuations = Counter(
            "rollout_exact_continuations",
            "Exact turns that went on from their segment, by how the env's new tokens were found: in the render"
            " of the whole conversation after the ids sampled, after the reply's text tokenized on its own, or"
            " by a render of the conversation so far; or appended, the template's render of the new messages"
            " alone (a template that renders history otherwise, as reasoning models' do)",
            ["how"],
            registry=r,
        )
        self._continued = {how: self.continuations.labels(how=how) for how in get_args(Continuation)}
        self.turns = Counter("rollout_turns", "Policy turns generated, by policy version", ["version"], registry=r)
        self.replicas = Gauge(
            "rollout_replicas",
            "Model server replicas by route and state: joining, serving, restoring, paused, excluded, draining",
            ["role", "state"],
            registry=r,
        )
        self.policy_updates = Histogram(
            "rollout_policy_update_seconds", "Policy updates, by kind", ["kind"], buckets=_LATENCY_BUCKETS, registry=r
        )

    def watch_replicas(self, rows: Callable[[], Iterable[tuple[str, str, int, int | None]]]) -> None:
        """Read at each scrape: (role, replica URL, episodes in flight, its KV turn bound or None)."""
        self.registry.register(_ReplicaLoad(rows))

    def replicas_in(self, role: str, counts: Mapping[str, int]) -> None:
        """How many of a route's replicas stand in each phase (server/policy/replica_states.py)."""
        for phase, count in counts.items():
            self.replicas.labels(role=role, state=phase).set(count)

    def forget_env(self, url: str) -> None:
        """An env removed: its series goes (it held no episode), rather than staying at 0 for ever."""
        try:
            self.episodes_in_flight.remove(url)
        except KeyError:  # no episode ever ran there
            pass

    def completion_done(self, seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.inference_latency.observe(seconds)
        self._prompt_tokens.inc(prompt_tokens)
        self._completion_tokens.inc(completion_tokens)

    def continued(self, how: Continuation) -> None:
        self._continued[how].inc()

    def policy_update(self, kind: str, seconds: float) -> None:
        self.policy_updates.labels(kind=kind).observe(seconds)

    def attempt_done(self, attempt: Attempt) -> None:
        self.attempts.labels(status=attempt.status).inc()
        self.phase.labels(phase="queued").observe(attempt.timings.queued_s)
        self.phase.labels(phase="inference").observe(attempt.timings.inference_s)
        self.phase.labels(phase="env").observe(attempt.timings.env_s)
        if attempt.reward is not None:
            self.rewards.observe(attempt.reward)

    def group_done(self, group: GroupResult) -> None:
        self.groups.labels(outcome="all_scored" if group.counts.failed == 0 else "some_failed").inc()
        self.group_latency.observe(group.wall_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaLoad(Collector):
    """Each replica's load and the bound on its turns (backends/kv_admission.py), as they are now."""

    def __init__(self, rows: Callable[[], Iterable[tuple[str, str, int, int | None]]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily]:
        episodes = GaugeMetricFamily(
            "rollout_replica_episodes", "Episodes in flight pinned to each replica", labels=["role", "replica"]
        )
        cap = GaugeMetricFamily(
            "rollout_replica_turn_cap",
            "Turns in flight each replica may have (KV-aware admission); absent: no bound",
            labels=["role", "replica"],
        )
        for role, url, count, bound in self.rows():
            episodes.add_metric([role, url], count)
            if bound is not None:
                cap.add_metric([role, url], bound)
        yield episodes
        yield cap
