"""The viewer over the running service: the newest groups kept in memory as they finish, and a short
time series of the service's counters, sampled every SAMPLE_EVERY_S while it runs.

Memory stays bounded over a run of any length: SUMMARIES_KEPT rows for the group list, the full
results of the newest GROUPS_KEPT groups for their pages, fewer when they are large (TOKENS_KEPT;
older ones: `rollout-service view RUNLOG` reads them from the run log), and SAMPLES_KEPT samples
(half an hour at one per two seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from ..protocol import GroupResult
from .book import GroupPage, GroupQuery, GroupSummary, RunTally, page, summarize
from .overview import LagBucket, Overview, ReplicaNow, Sample, TaskRow

if TYPE_CHECKING:
    from ..server.service import RolloutService

SUMMARIES_KEPT = 20_000
GROUPS_KEPT = 200
SAMPLES_KEPT = 900
SAMPLE_EVERY_S = 2.0
# Token ids and logprobs held in the kept results, about 37 bytes each as Python objects: ~150 MB. A
# count of groups alone is no bound: a chat-mode group of 8 attempts x 20 turns (each turn's prompt
# ids again) holds ~1M of them, so 200 such groups would pin 7 GB the service had otherwise freed.
TOKENS_KEPT = 4_000_000


def tokens_held(result: GroupResult) -> int:
    """The token ids and logprobs `result` holds: what its size grows with."""
    held = 0
    for attempt in result.attempts:
        for segment in attempt.trajectory or []:
            held += len(segment.token_ids) + len(segment.loss_mask) + len(segment.logprobs)
        for turn in attempt.turns:
            held += len(turn.prompt_token_ids or []) + len(turn.completion_token_ids or []) + len(turn.logprobs or [])
    return held


def metric_samples(registry: CollectorRegistry, name: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of one metric family of the service's own registry."""
    for family in registry.collect():
        if family.name == name:
            return [(s.name, s.labels, s.value) for s in family.samples]
    return []


class LiveBook:
    def __init__(self, service: RolloutService) -> None:
        self.service = service
        self.summaries: deque[GroupSummary] = deque(maxlen=SUMMARIES_KEPT)
        self.results: OrderedDict[int, tuple[GroupResult, int]] = OrderedDict()  # seq -> (result, tokens_held)
        self.tokens = 0  # tokens_held of the kept results
        self.tally = RunTally()
        self.samples: deque[Sample] = deque(maxlen=SAMPLES_KEPT)

    def record(self, result: GroupResult) -> None:
        """Every finished group, on the event loop as it finishes: a summary and a reference, no copy."""
        seq = self.tally.groups
        info = self.service.envs.task_info.get(result.task_id)
        summary = summarize(seq, result, info.family if info else None)
        self.tally.add(summary, result)
        self.summaries.append(summary)
        held = tokens_held(result)
        self.results[seq] = (result, held)
        self.tokens += held
        while len(self.results) > GROUPS_KEPT or (self.tokens > TOKENS_KEPT and len(self.results) > 1):
            self.tokens -= self.results.popitem(last=False)[1][1]

    def sample(self) -> None:
        service = self.service
        tokens = sum(
            value
            for name, labels, value in metric_samples(service.metrics.registry, "rollout_tokens")
            if name.endswith("_total") and labels.get("kind") == "completion"
        )
        detail = service.health.detail()
        self.samples.append(
            Sample(
                t=round(time.time(), 3),
                groups=self.tally.groups,
                completion_tokens=int(tokens),
                pools={e.url: round(e.held / e.pool, 4) if e.pool else 0.0 for e in detail.envs or []},
                replicas={m.url: m.outstanding for m in detail.models or [] if m.role == "policy"},
            )
        )

    async def sample_forever(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY_S)

    # -- what the endpoints ask ------------------------------------------------------------------

    def overview(self) -> Overview:
        detail = self.service.health.detail()
        outstanding = {m.url: m.outstanding for m in detail.models or [] if m.role == "policy"}
        replicas = [
            ReplicaNow(url=r.url, version=r.version, routed=r.routed, outstanding=outstanding.get(r.url, 0))
            for r in (detail.policy.replicas if detail.policy else [])
        ]
        return Overview(
            mode="live",
            run_id=self.service.run_id,
            status=detail.status,
            groups=self.tally.groups,
            policy_version=detail.policy.version if detail.policy else None,
            samples=list(self.samples),
            replicas=replicas,
            lag=self.lag(),
            signal_by_version=self.tally.signal_by_version(),
            failures=self.tally.failures_by_kind(),
        )

    def lag(self) -> list[LagBucket]:
        """The hand-out lag histogram (rollout_sampler_handed_lag), per bucket rather than cumulative."""
        cumulative = [
            (labels["le"], value)
            for name, labels, value in metric_samples(self.service.metrics.registry, "rollout_sampler_handed_lag")
            if name.endswith("_bucket")
        ]
        buckets, below = [], 0.0
        for le, value in cumulative:
            buckets.append(LagBucket(le=le.removesuffix(".0"), count=int(value - below)))
            below = value
        return buckets

    def groups(self, query: GroupQuery) -> GroupPage:
        return page(list(self.summaries), query)

    async def refresh(self) -> None:
        """Nothing to read: groups arrive as they finish."""

    async def group(self, seq: int) -> GroupResult | None:
        kept = self.results.get(seq)
        return kept[0] if kept else None

    def tasks(self) -> list[TaskRow]:
        info = self.service.envs.task_info
        return [
            TaskRow(family=info[s.task_id].family if s.task_id in info else None, **s.model_dump())
            for s in self.service.task_stats.stats()
        ]


def hook(app: FastAPI, book: LiveBook) -> None:
    """Feed `book` every finished group (after whatever already listens), and sample while the app runs."""
    admission = book.service.admission
    earlier: Callable[[GroupResult], None] | None = admission.on_result

    def on_result(result: GroupResult) -> None:
        if earlier is not None:
            earlier(result)
        book.record(result)

    admission.on_result = on_result
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with inner(app):
            sampler = asyncio.ensure_future(book.sample_forever())
            try:
                yield
            finally:
                sampler.cancel()
                await asyncio.wait([sampler])

    app.router.lifespan_context = lifespan
