"""The sampler's Prometheus series: groups kept and dropped, hand-out lag, what the streams buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram

if TYPE_CHECKING:
    from ..metrics import Metrics
    from .streams import SamplerStreams


class SamplerMetrics:
    def __init__(self, metrics: Metrics, streams: SamplerStreams) -> None:
        r = metrics.registry
        dropped = "Groups the sampler ran and did not keep, by reason"
        self.dropped = PromCounter("rollout_sampler_dropped_groups", dropped, ["reason"], registry=r)
        self.kept = PromCounter("rollout_sampler_kept_groups", "Groups the sampler kept", registry=r)
        self.lag = Histogram(
            "rollout_sampler_handed_lag",
            "Policy updates each group a stream handed out was behind the current version",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
            registry=r,
        )
        self.buffered = Gauge("rollout_sampler_buffered_groups", "Groups buffered in sampler streams", registry=r)
        self.buffered.set_function(lambda: sum(len(s.buffer) for s in streams.streams.values()))
        self.bound = Gauge("rollout_sampler_buffer_bound", "Sum of the sampler streams' buffer bounds", registry=r)
        self.bound.set_function(lambda: sum(s.body.buffer for s in streams.streams.values()))
        self.open = Gauge("rollout_sampler_streams", "Sampler streams open", registry=r)
        self.open.set_function(lambda: len(streams.streams))
