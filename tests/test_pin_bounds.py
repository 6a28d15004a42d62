"""The bounds of evaluation on a pinned version, on PolicyManager alone (no model server: these are
the manager's own decisions about versions it was told of, before any request is sent)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout_service.server.errors import Conflict, NotFound, RequestRefused, TooBusy
from rollout_service.server.metrics import Metrics
from rollout_service.server.policy.manager import PolicyManager, PolicyVersion


def _manager(max_loras: int) -> PolicyManager:
    client = SimpleNamespace(endpoints=[], on_failure=None)
    manager = PolicyManager(client, "m", metrics=Metrics())  # type: ignore[arg-type]
    manager.book.max_loras = max_loras
    return manager


def _serve(manager: PolicyManager, label: str, kind: str = "lora") -> PolicyVersion:
    """Make `label` current, as update() would (without a model server)."""
    step = manager.current.step + 1
    beneath = manager.current.weights if manager.current.kind == "lora" else manager.current
    version = PolicyVersion(
        label, step, kind, f"m@{label}" if kind == "lora" else "m", "/x", beneath if kind == "lora" else None
    )
    manager.book.adopt(version)
    return version


def test_pins_past_max_loras_are_refused_and_room_comes_back_when_unpinned():
    """--max-loras 2: the current adapter and one pinned earlier one fill it; a second earlier
    version is refused (429) too_many_pins until the first pin is released. Break tried: the bound's
    count leaving out the current adapter -> the second pin is accepted."""
    asyncio.run(_pins_past_max_loras())  # an unpin spawns the adapter's unload: a loop must run


async def _pins_past_max_loras() -> None:
    manager = _manager(max_loras=2)
    _serve(manager, "a")
    _serve(manager, "b")
    pinned_a = manager.pin("a")  # a (pinned) + b (current): 2 adapters
    _serve(manager, "c")  # a pinned, c current: still 2; b unused
    with pytest.raises(RequestRefused) as refused:
        manager.pin("b")
    assert isinstance(refused.value, TooBusy) and refused.value.error == "too_many_pins"
    assert manager.pin("a") is pinned_a and manager.pin("c").label == "c"  # held already / current: no new room
    manager.unpin(pinned_a)
    manager.unpin(pinned_a)
    await asyncio.sleep(0)  # the unload of a (no replica here to ask) runs
    assert manager.pin("b").label == "b"
    with pytest.raises(RequestRefused) as unloaded:
        manager.check_pin("a")
    assert unloaded.value.error == "version_not_served" and "unloaded" in unloaded.value.message


def test_full_weights_replaced_are_not_served():
    """A pin on the base weights holds while an adapter stands on them, and is refused once full
    weights replace them; so is an adapter trained on the old weights."""
    manager = _manager(max_loras=4)
    _serve(manager, "a")
    assert manager.check_pin("base").label == "base"
    _serve(manager, "w1", kind="weights")
    for label in ("base", "a"):
        with pytest.raises(RequestRefused) as refused:
            manager.check_pin(label)
        assert isinstance(refused.value, Conflict) and refused.value.error == "version_not_served"
        assert "full weights were replaced" in refused.value.message
    with pytest.raises(RequestRefused) as unknown:
        manager.check_pin("nope")
    assert isinstance(unknown.value, NotFound)
