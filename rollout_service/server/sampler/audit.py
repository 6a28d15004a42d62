"""The bias audit of a sampler stream: what kept groups look like next to dropped and cancelled ones.

Dropping stale groups, or filtering, can starve the long and hard tasks (they finish last, wait
longest, fail most): the audit puts the kept groups' lengths, turns and pass rates beside the others'
so a trainer can see whether its draw is biased, on every pull.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from ...protocol import GroupResult
from ...sampler_protocol import AuditPart, BiasAudit, Spread

_VALUES_KEPT = 10_000  # per kind and figure: a long-lived stream's audit stays bounded

Kind = Literal["kept", "dropped", "cancelled"]


@dataclass(frozen=True)
class Shape:
    """One group's figures for the audit; None where its result never came."""

    completion_tokens: float | None
    turns: float | None
    pass_rate: float | None
    wall_s: float


def shape_of(group: GroupResult) -> Shape:
    attempts = max(1, len(group.attempts))
    turns = sum(len(a.turns) for a in group.attempts)
    return Shape(group.completion_tokens / attempts, turns / attempts, group.pass_rate, group.wall_s)


def spread(values: deque[float]) -> Spread | None:
    if not values:
        return None
    ranked = sorted(values)

    def rank(q: float) -> float:
        return ranked[max(0, math.ceil(q * len(ranked)) - 1)]

    return Spread(mean=round(sum(ranked) / len(ranked), 6), p50=round(rank(0.5), 6), p90=round(rank(0.9), 6))


@dataclass
class _Part:
    groups: int = 0
    figures: dict[str, deque[float]] = field(
        default_factory=lambda: {
            name: deque(maxlen=_VALUES_KEPT) for name in ("completion_tokens", "turns", "pass_rate", "wall_s")
        }
    )

    def add(self, shape: Shape | None) -> None:
        self.groups += 1
        if shape is None:
            return
        for name, values in self.figures.items():
            value = getattr(shape, name)
            if value is not None:
                values.append(float(value))

    def report(self) -> AuditPart:
        return AuditPart(groups=self.groups, **{name: spread(values) for name, values in self.figures.items()})


class Audit:
    def __init__(self) -> None:
        self.parts: dict[Kind, _Part] = {"kept": _Part(), "dropped": _Part(), "cancelled": _Part()}

    def add(self, kind: Kind, shape: Shape | None) -> None:
        self.parts[kind].add(shape)

    def report(self) -> BiasAudit:
        return BiasAudit(**{kind: part.report() for kind, part in self.parts.items()})
