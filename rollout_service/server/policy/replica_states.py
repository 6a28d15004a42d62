"""Where each replica of one model route stands: the one record of it, and the only writer of the
pool's routing (`ReplicaPool.add`, `exclude`, `readmit`, `drain`, `remove`).

A replica is in one phase at a time:

- joining: added at runtime, out of routing until checked to serve the current version;
- serving(version): routed; the only phase that is;
- restoring: found on other weights (restarted, a reload that failed); a restore brings it to the
  current version. A restore under way decides what comes next, so an exclusion meanwhile only
  changes the reason;
- paused: held paused by this service and not resumed (a resume failed, or the trainer's lease
  ran out on weights nobody named), or found paused when it joined. Never routed before it is
  resumed: a turn there would hang;
- excluded(reason): out of routing until the monitor has checked it;
- draining: being removed; no event but the removal takes it out of this phase.

The trainer's pause (POST /policy/pause) is not a replica's phase: it holds every turn of the route
before one starts (PauseLease.wait_unpaused) while the replicas stay routed.

A transition not in the table below is the caller's bug, not a user's mistake: it raises
IllegalTransition. Events about a replica already removed are nobody's concern and change nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum

from ...backends.replica_pool import Endpoint, ReplicaPool
from ...protocol import ReplicaState
from ..metrics import Metrics


class Phase(StrEnum):
    JOINING = "joining"
    SERVING = "serving"
    RESTORING = "restoring"
    PAUSED = "paused"
    EXCLUDED = "excluded"
    DRAINING = "draining"


@dataclass(frozen=True)
class Standing:
    phase: Phase
    version: str | None = None  # serving: the version it serves; draining: the one it served, if known
    reason: str | None = None  # why it is out of routing: every phase but serving
    paused: bool = False  # restoring: still held paused by this service (the restore resumes it first)

    @property
    def routed(self) -> bool:
        return self.phase is Phase.SERVING


class IllegalTransition(RuntimeError):
    """An event a replica in its phase cannot take: a bug in the caller."""


_J, _S, _R, _P, _X, _D = Phase
# (event, the phase it finds) -> the phase it leads to. A pair not here is refused (IllegalTransition).
TRANSITIONS: dict[tuple[str, Phase], Phase] = {
    # Checked (or made) to serve a version: routed. Never while held paused (a turn there would hang);
    # a draining replica keeps draining, with the version.
    **{("serve", p): _S for p in (_J, _S, _R, _X)},
    ("serve", _D): _D,
    # Not known to serve the current version. A restore under way decides; a paused replica is resumed
    # first; a draining one leaves anyway: those keep their phase.
    **{("exclude", p): _X for p in (_J, _S, _X)},
    **{("exclude", p): p for p in (_R, _P, _D)},
    # Paused by this service and not resumed (a restore resumes it first; a draining one leaves).
    **{("hold_paused", p): _P for p in (_J, _S, _X, _P)},
    **{("hold_paused", p): p for p in (_R, _D)},
    # Resumed: a paused replica is still out of routing until it is checked.
    ("resumed", _P): _X,
    **{("resumed", p): p for p in (_J, _S, _R, _X, _D)},
    **{("restore", p): _R for p in (_J, _S, _X, _P)},
    # A restore that did not end serving leaves it out of routing (paused, if it never resumed it).
    ("restore_ended", _R): _X,
    **{("restore_ended", p): p for p in (_J, _S, _P, _X, _D)},
    **{("drain", p): _D for p in (_J, _S, _R, _P, _X)},
    ("forget", _D): _D,  # and it is gone
}


class ReplicaStates:
    """The phase of every replica of one pool; each transition sets the pool's routing to follow it."""

    def __init__(self, pool: ReplicaPool, metrics: Metrics, role: str, version: str | None = None) -> None:
        self.pool = pool
        self.role = role
        self._metrics = metrics
        self._of: dict[str, Standing] = {e.url: Standing(Phase.SERVING, version) for e in pool.endpoints}
        self._count()

    # -- reading -------------------------------------------------------------------------------

    def phase(self, endpoint: Endpoint) -> Phase | None:
        standing = self._of.get(endpoint.url)
        return None if standing is None else standing.phase

    def version(self, endpoint: Endpoint) -> str | None:
        """The version it is known to serve (None: not known, or a route without versions)."""
        standing = self._of.get(endpoint.url)
        return None if standing is None else standing.version

    def restoring(self) -> set[str]:
        return {url for url, s in self._of.items() if s.phase is Phase.RESTORING}

    def held_paused(self, endpoint: Endpoint) -> bool:
        """Paused by this service and not resumed since (to resume before anything else is asked of it)."""
        now = self._of.get(endpoint.url)
        return now is not None and (now.phase is Phase.PAUSED or (now.phase is Phase.RESTORING and now.paused))

    def report(self, endpoint: Endpoint) -> ReplicaState:
        """What GET /policy, /health/detail and the replica routes say of it."""
        standing = self._of.get(endpoint.url) or Standing(Phase.EXCLUDED, reason="not present")
        return ReplicaState(
            url=endpoint.url,
            version=standing.version,
            state=standing.phase.value,
            routed=standing.routed,
            reason=standing.reason,
            draining=standing.phase is Phase.DRAINING,
        )

    def counts(self) -> dict[Phase, int]:
        found = Counter(s.phase for s in self._of.values())
        return {phase: found[phase] for phase in Phase}

    # -- membership ------------------------------------------------------------------------------

    def join(self, endpoint: Endpoint, reason: str) -> None:
        """A replica added at runtime, routed once it is checked (`serve`)."""
        self._new(endpoint, Standing(Phase.JOINING, reason=reason))

    def admit(self, endpoint: Endpoint) -> None:
        """A replica added at runtime and routed at once (a route with no versions to check)."""
        self._new(endpoint, Standing(Phase.SERVING))

    def start_on(self, version: str) -> None:
        """At start: the replicas serve `version` (as /weight_info says); one held paused stays so."""
        self._of = {url: replace(s, version=version) if s.routed else s for url, s in self._of.items()}

    def drain(self, endpoint: Endpoint, reason: str) -> None:
        """No new turn goes to it; it leaves once its turns are over (`forget`)."""
        now, to = self._known(endpoint, "drain")
        self._set(endpoint, Standing(to, now.version if now.routed else None, reason))

    def forget(self, endpoint: Endpoint) -> None:
        """A drained replica's turns are over: it leaves the pool."""
        self._known(endpoint, "forget")
        del self._of[endpoint.url]
        self._count()
        self.pool.remove(endpoint)

    # -- what the policy finds -------------------------------------------------------------------

    def serve(self, endpoint: Endpoint, version: str | None) -> None:
        """Checked (or made) to serve `version`: routed (a draining one keeps draining)."""
        if (step := self._step(endpoint, "serve")) is not None:
            now, to = step
            if now.paused:
                raise IllegalTransition(f"{self.role} replica {endpoint.url}: serve while still held paused")
            self._set(endpoint, Standing(to, version, now.reason if to is Phase.DRAINING else None))

    def exclude(self, endpoint: Endpoint, reason: str) -> None:
        """Out of routing until checked: what it serves is not known (or not the current version)."""
        if (step := self._step(endpoint, "exclude")) is not None:
            now, to = step
            self._set(
                endpoint, replace(now, phase=to, version=None, reason=now.reason if to is Phase.DRAINING else reason)
            )

    def hold_paused(self, endpoint: Endpoint, reason: str) -> None:
        """Paused by this service and not resumed: never routed until it is."""
        if (step := self._step(endpoint, "hold_paused")) is not None:
            now, to = step
            if to is not Phase.DRAINING:
                self._set(endpoint, Standing(to, None, reason, paused=to is Phase.RESTORING))

    def resumed(self, endpoint: Endpoint) -> None:
        """Resumed: no longer held paused (a paused one stays out of routing until checked)."""
        if (step := self._step(endpoint, "resumed")) is not None:
            now, to = step
            if now.phase is Phase.PAUSED or now.paused:
                self._set(endpoint, replace(now, phase=to, paused=False))

    def restore(self, endpoint: Endpoint, reason: str) -> None:
        """On other weights: out of routing while a restore brings it to the current version."""
        now, to = self._known(endpoint, "restore")
        self._set(endpoint, Standing(to, None, reason, paused=now.phase is Phase.PAUSED))

    def restore_ended(self, endpoint: Endpoint) -> None:
        """The restore is over; one that did not end serving leaves the replica out of routing (paused
        where it never resumed it)."""
        if (step := self._step(endpoint, "restore_ended")) is not None:
            now, to = step
            if now.phase is Phase.RESTORING:
                self._set(endpoint, Standing(Phase.PAUSED if now.paused else to, None, now.reason))

    # -- the table -------------------------------------------------------------------------------

    def _known(self, endpoint: Endpoint, event: str) -> tuple[Standing, Phase]:
        """Where `event` takes a replica that must be present (membership's events: a bug otherwise)."""
        now = self._of.get(endpoint.url)
        if now is None or endpoint not in self.pool.endpoints:
            raise IllegalTransition(f"{self.role} replica {endpoint.url}: {event}, but it is not present")
        step = self._step(endpoint, event, now)
        assert step is not None
        return step

    def _step(self, endpoint: Endpoint, event: str, now: Standing | None = None) -> tuple[Standing, Phase] | None:
        """Where `event` takes the replica, by the table; None for a replica removed meanwhile (an event
        about it changes nothing)."""
        now = now or (self._of.get(endpoint.url) if endpoint in self.pool.endpoints else None)
        if now is None:
            return None
        to = TRANSITIONS.get((event, now.phase))
        if to is None:
            raise IllegalTransition(f"{self.role} replica {endpoint.url}: {event} while {now.phase}")
        return now, to

    def _new(self, endpoint: Endpoint, standing: Standing) -> None:
        if endpoint.url in self._of:
            raise IllegalTransition(f"{self.role} replica {endpoint.url} is present already")
        self.pool.add(endpoint, None if standing.routed else standing.reason)
        self._set(endpoint, standing)

    def _set(self, endpoint: Endpoint, standing: Standing) -> None:
        """The one place the pool's routing is written: routed exactly while serving."""
        self._of[endpoint.url] = standing
        if standing.phase is Phase.SERVING:
            self.pool.readmit(endpoint)
        elif standing.phase is Phase.DRAINING:
            if not endpoint.draining:
                self.pool.drain(endpoint, standing.reason or "draining")
        else:
            self.pool.exclude(endpoint, standing.reason or standing.phase.value)
        self._count()

    def _count(self) -> None:
        self._metrics.replicas_in(self.role, {phase.value: n for phase, n in self.counts().items()})
