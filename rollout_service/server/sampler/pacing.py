"""Pacing a sampler stream to its staleness bound, instead of dropping and replacing stale groups.

Policy versions advance once per trainer step, and the trainer takes `step` groups a step. A group
started now waits behind the groups already running and buffered; handed out oldest first, it comes
out `ahead // step` steps after the pull in progress (or the next one), so it is at most
`max_staleness` updates old when handed out while running + buffered stays within the pull's groups
still due plus `max_staleness * step`. Started past that, it would be dropped as stale: compute spent
on exactly the groups (long, hard tasks finish last) whose loss biases training. Attempts that fall
behind while running are re-run by the runner (the group's own max_staleness).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections import deque

    from .sampler import Finished


@dataclass
class Pacing:
    max_staleness: int | None
    step: int | None  # groups per trainer step: stated when the stream was made, else the last pull's count
    pull_left: int = 0  # groups the pull in progress still has to hand out

    def ahead(self) -> int | None:
        """Groups that may be running or buffered now; None: unbounded (no max_staleness, or no step known yet)."""
        if self.max_staleness is None or self.step is None:
            return None
        return self.pull_left + self.max_staleness * self.step


def take_oldest(buffer: deque[Finished], lag_of: Callable[[Finished], int]) -> Finished:
    """Remove and return the buffered group whose oldest turn is furthest behind, the earliest started among
    equals: a group that finished late (a long episode) is not passed over by younger ones until it is stale."""
    index = max(range(len(buffer)), key=lambda i: (lag_of(buffer[i]), -buffer[i].seq))
    item = buffer[index]
    del buffer[index]
    return item
