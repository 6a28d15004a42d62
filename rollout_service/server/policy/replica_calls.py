"""One call to each policy replica, and what it came to: the pieces the pause, the updates and the
restores share (an outcome per replica; the weights' label, checksums and model list as the policy
reads them from a replica's Engine)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from ...backends.engine import Engine
from ...backends.errors import InferenceError, WeightUpdateError
from ...backends.replica_pool import Endpoint


@dataclass
class Outcome:
    endpoint: Endpoint
    ok: bool
    seconds: float
    error: str | None = None
    refused: bool = False
    unchanged: bool = False  # it failed, but is known to serve what it served before

    @property
    def url(self) -> str:
        return self.endpoint.url


class Unchanged(WeightUpdateError):
    """The reload worked, and the weights are the ones already served."""


async def timed(endpoint: Endpoint, call: Awaitable[object]) -> Outcome:
    """`call` on the replica at `endpoint`: its outcome, never an exception (but cancellation)."""
    started = time.monotonic()
    try:
        await call
        return Outcome(endpoint, True, round(time.monotonic() - started, 3))
    except WeightUpdateError as exc:
        outcome = Outcome(endpoint, False, round(time.monotonic() - started, 3), exc.detail, exc.refused)
        outcome.unchanged = isinstance(exc, Unchanged)
        return outcome
    except Exception as exc:  # a closed client, an answer that is not JSON: this replica's failure
        return Outcome(endpoint, False, round(time.monotonic() - started, 3), f"{type(exc).__name__}: {exc}"[:500])


async def failed(outcome: Outcome) -> Outcome:
    """An outcome known without asking the replica, among those gathered from the others."""
    return outcome


def describe(outcomes: list[Outcome], verb: str) -> str:
    return "; ".join(f"{o.url} {verb}: {o.error}" for o in outcomes if not o.ok)


async def read_label(engine: Engine) -> str | None:
    """The replica's /weight_info label; None where the route is not served (no dev mode: then
    nobody can have reloaded or relabelled it)."""
    try:
        return await engine.weight_version()
    except WeightUpdateError as exc:
        if exc.status == 404:
            return None
        raise


_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


async def read_checksums(engine: Engine) -> dict[str, str] | None:
    """vLLM's weight checksums, or None where they cannot tell whether the weights changed: not
    served, or some of zero bytes. vLLM's CPU build repacks the linear layers into its kernels' own
    format on CPUs that have those kernels (seen on an AMD EPYC with AVX-512 BF16: 120 of 182
    tensors), leaving empty `weight` tensors behind, so a checkpoint that differs only there would
    look unchanged."""
    try:
        sums = await engine.weight_checksums()
    except WeightUpdateError:
        return None
    return None if _EMPTY_DIGEST in sums.values() else sums


async def is_paused(engine: Engine) -> bool:
    try:
        return await engine.is_paused()
    except WeightUpdateError:
        return False  # no dev mode: nothing can have paused it


async def listed_models(engine: Engine) -> list[str]:
    """The models the replica lists, or WeightUpdateError: a replica whose list cannot be read cannot
    be told to serve a version."""
    try:
        return await engine.models()
    except (InferenceError, ValueError) as exc:
        raise WeightUpdateError(engine.url, "list models", str(exc), getattr(exc, "status", None)) from None
