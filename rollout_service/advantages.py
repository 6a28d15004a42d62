"""Group-relative advantages (GRPO): each scored attempt against its own group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

_EPS = 1e-6


def group_advantages(rewards: Sequence[float | None], kind: Literal["mean", "zscore"] = "mean") -> list[float | None]:
    """Advantages over the scored attempts only; an unscored attempt (None) gets None.

    mean: r - mean(r), as GraphJin's client does. zscore: (r - mean) / std, with std the
    population std of the scored rewards; a group whose rewards are all equal gets zeros.
    """
    if kind not in ("mean", "zscore"):
        raise ValueError(f"unknown advantage kind {kind!r}: use 'mean' or 'zscore'")
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    if scored.size == 0:
        return [None for _ in rewards]
    centred = scored - scored.mean()
    if kind == "zscore":
        std = scored.std()
        centred = centred / std if std > _EPS else np.zeros_like(centred)
    values = iter(centred.tolist())
    return [None if r is None else round(next(values), 6) for r in rewards]


def summarize(rewards: Sequence[float | None]) -> tuple[float | None, float | None, bool]:
    """(mean, std, all_equal) of the rewards that are not None. `all_equal` is also true with fewer
    than two: a group with 0 or 1 rewards has nothing to compare, so no gradient either."""
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    if scored.size == 0:
        return None, None, True
    return (
        round(float(scored.mean()), 6),
        round(float(scored.std()), 6),
        bool(scored.size < 2 or np.ptp(scored) <= _EPS),
    )
