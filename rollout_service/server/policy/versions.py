"""The policy's versions: what each label names, which one is current, which the replicas can still
serve, and what holds each one (turns in flight, pinned groups).

A version is a label the trainer gives an update. The service, not the trainer, records which
version generated each turn: a turn takes a lease on the version current when it is sent and
names that version's weights (a LoRA adapter has a name of its own per version, so a turn
already sent finishes on the adapter it named). A full-weight update changes the weights under
the turns in flight (vLLM pauses them and goes on after the reload), so such a turn records
both versions and is marked mixed.

This module asks no replica anything: the policy manager (manager.py) acts on what it says.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Literal

from ...protocol import PolicyUpdateResult
from ..errors import Conflict, NotFound, TooBusy

VersionKind = Literal["base", "lora", "weights", "pushed"]
DEFAULT_WEIGHTS = (None, "default")  # what /weight_info says of weights nobody has relabelled
# The label a replica carries while it reloads: one that still says so afterwards failed half-way
# (vLLM reloads in place, so its weights are gone) and must not serve until it is reloaded.
RELOADING = "reloading:"


@dataclass(frozen=True)
class PolicyVersion:
    label: str
    step: int  # successful updates before it: staleness is a difference of steps
    kind: VersionKind
    served_model: str  # the model name a turn is sent with
    path: str | None = None  # where its adapter or weights were loaded from (to restore a replica)
    weights: PolicyVersion | None = None  # under an adapter: the full-weight version beneath it

    @property
    def weights_label(self) -> str | None:
        """What /weight_info says on a replica that serves this version (None: the base checkpoint)."""
        under = self.weights if self.kind == "lora" else self
        return None if under is None or under.kind == "base" else under.label


@dataclass(frozen=True)
class TurnLease:
    version: PolicyVersion
    weights_epoch: int


def weights_match(label: str | None, wanted: str | None) -> bool:
    """A replica labelled `label` serves the full weights labelled `wanted` (None: the base checkpoint,
    which a restarted replica serves too)."""
    return label == wanted or (wanted is None and label in DEFAULT_WEIGHTS)


class VersionBook:
    """The versions served here, the current one, and the turns and pinned groups on each (which
    version each replica serves is its standing's: replica_states.py)."""

    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self.current = PolicyVersion("base", 0, "base", base_model)
        self.steps: dict[str, int] = {"base": 0}
        self.weights_epoch = 0  # bumped by every update that changes the base weights
        self.in_flight: Counter[str] = Counter()  # served model name -> turns in flight on it
        # Evaluation on a pinned version: groups pinned to each served model (an adapter stays loaded while
        # pinned), the versions that can be named, and adapters already unloaded (no longer servable).
        self.pins: Counter[str] = Counter()
        self.known: dict[str, PolicyVersion] = {"base": self.current}
        self.unloaded: set[str] = set()
        self.max_loras = 4  # vLLM's --max-loras on the replicas (the service's --max-loras)
        self.history: deque[PolicyUpdateResult] = deque(maxlen=20)

    def start_on(self, label: str) -> None:
        """The replicas serve full weights a trainer labelled `label` before this service started."""
        self.current = PolicyVersion(label, 0, "weights", self.base_model)
        self.steps = {label: 0}
        self.known = {label: self.current}

    def adopt(self, version: PolicyVersion) -> None:
        """`version` is current from now on (an update some replica took)."""
        self.current = version
        self.steps[version.label] = version.step
        self.known[version.label] = version

    def behind(self, label: str) -> int:
        """How many updates `label` is behind the current version."""
        return self.current.step - self.steps.get(label, 0)

    # -- turns -------------------------------------------------------------------------------

    def take(self, pin: str | None) -> TurnLease:
        """The version a turn about to be sent is generated with (the pinned one, if named)."""
        version = self.servable(pin) if pin is not None else self.current
        self.in_flight[version.served_model] += 1
        return TurnLease(version, self.weights_epoch)

    def give_back(self, lease: TurnLease) -> bool:
        """The turn is done; whether its adapter is now unused (to be unloaded)."""
        name = lease.version.served_model
        self.in_flight[name] -= 1
        if self.in_flight[name] > 0:
            return False
        del self.in_flight[name]
        return self.unused_adapter(lease.version)

    def unused_adapter(self, version: PolicyVersion) -> bool:
        """An adapter no turn in flight, no pin and not the current version uses: it may be unloaded."""
        name = version.served_model
        return (
            version.kind == "lora"
            and name != self.current.served_model
            and name not in self.in_flight
            and name not in self.pins
        )

    # -- evaluation on a pinned version --------------------------------------------------------

    def servable(self, label: str) -> PolicyVersion:
        """The version `label` names, if the replicas can still serve it; else NotFound or Conflict saying why.
        Full weights (base, a reload, a push) are servable while they are the replicas' weights; an
        adapter, while it is loaded over the weights it was trained on."""
        version = self.known.get(label)
        if version is None:
            raise NotFound(
                "unknown_version",
                f"no policy version {label!r} was served here (GET /policy names the current one)",
            )
        if version is self.current:
            return version
        if version.weights_label != self.current.weights_label:
            raise Conflict(
                "version_not_served",
                f"version {label!r} cannot be served: the replicas' full weights were replaced since "
                f"(they serve {self.current.weights_label or 'the base checkpoint'} now); a pin holds a LoRA "
                "version, or full weights still served",
            )
        if version.kind == "lora" and version.served_model in self.unloaded:
            raise Conflict(
                "version_not_served",
                f"version {label!r} cannot be served: its adapter was unloaded once nothing used it; pin a "
                "version while it is current (or while a group pinned to it runs) to keep it loaded",
            )
        return version

    def check_pin(self, label: str) -> PolicyVersion:
        """The version a group may pin, or a refusal: not servable, or one adapter past --max-loras (TooBusy)."""
        version = self.servable(label)
        name = version.served_model
        if version.kind == "lora" and name not in self.pins and name != self.current.served_model:
            kept = {n for n in self.pins if n != self.base_model}
            if self.current.kind == "lora":
                kept.add(self.current.served_model)
            if len(kept) + 1 > self.max_loras:
                raise TooBusy(
                    "too_many_pins",
                    f"pinning version {label!r} would keep {len(kept) + 1} adapters loaded (the current one and "
                    f"those pinned), over --max-loras={self.max_loras}: wait for pinned groups to finish",
                    retry_after_s=5,
                )
        return version

    def pin(self, label: str) -> PolicyVersion:
        """Hold `label`'s adapter loaded for a group pinned to it, until unpin()."""
        version = self.check_pin(label)
        self.pins[version.served_model] += 1
        return version

    def unpin(self, version: PolicyVersion) -> bool:
        """A pinned group is done; whether its adapter is now unused (to be unloaded)."""
        name = version.served_model
        self.pins[name] -= 1
        if self.pins[name] > 0:
            return False
        del self.pins[name]
        return self.unused_adapter(version)
