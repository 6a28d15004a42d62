"""The policy manager speaks to model servers only through the Engine interface (rollout_service/backends/engine.py):
an engine that is no HTTP server at all takes a LoRA update, a full-weight reload and a trainer's push.

The engine here is a test double on purpose: what is checked is that nothing in the policy code goes
around the interface to a vLLM URL (the doubles' URLs resolve nowhere), which a real vLLM cannot show.
The doubles' own record of what was asked of them is the oracle; the real vLLM path is tests/test_policy.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fake_vllm import adapter, checkpoint

from rollout_service.backends.answers import Completion, TokenizeAnswer
from rollout_service.backends.engine import Engine
from rollout_service.backends.errors import WeightUpdateError
from rollout_service.backends.replica_pool import ReplicaPool
from rollout_service.protocol import PolicyUpdate
from rollout_service.server.metrics import Metrics
from rollout_service.server.policy.manager import PolicyManager

BASE = "m"


class EngineDouble:
    """One model server as an object: its weights, their label, its adapters, paused or not, and the
    calls made of it, in order."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.weights, self.label = "launch", "default"
        self.adapters: dict[str, str] = {}
        self.paused = False
        self.calls: list[str] = []

    async def models(self) -> list[str]:
        return [BASE, *self.adapters]

    async def chat(self, **_: object) -> Completion:
        raise AssertionError("no turn is sent in this test")

    async def complete(self, **_: object) -> Completion:
        raise AssertionError("no turn is sent in this test")

    async def tokenize(self, **_: object) -> TokenizeAnswer:
        raise AssertionError("no turn is sent in this test")

    async def load_adapter(self, name: str, path: str) -> None:
        self.calls.append(f"load {name}")
        self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        self.calls.append(f"unload {name}")
        self.adapters.pop(name, None)

    async def pause(self) -> None:
        self.calls.append("pause")
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def reload_weights(self, path: str) -> None:
        if not self.paused:
            raise WeightUpdateError(self.url, "reload weights", "reloaded while turns run")
        self.calls.append("reload")
        self.weights = path

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset prefix cache")

    async def weight_checksums(self) -> dict[str, str]:
        return {"all": self.weights}

    async def set_weight_version(self, label: str) -> None:
        self.label = label

    async def weight_version(self) -> str | None:
        return self.label


def test_policy_updates_go_through_the_engine_interface_only(tmp_path: Path):
    """Break tried: read_label asking vLLM's /weight_info over HTTP at the replica's URL (a VllmServer
    made from it) instead of the replica's engine -> start() cannot read the label and the update fails."""
    doubles = {f"http://engine-{i}.invalid": EngineDouble(f"http://engine-{i}.invalid") for i in range(2)}

    def make_engine(url: str) -> Engine:
        return doubles[url]

    async def go() -> None:
        pool = ReplicaPool(list(doubles), engine=make_engine)
        manager = PolicyManager(pool, BASE, Metrics())
        try:
            await manager.start()
            await manager.update(PolicyUpdate(version="a1", lora={"path": adapter(tmp_path, "a1")}))
            assert all(d.adapters == {f"{BASE}@a1": str(tmp_path / "a1")} for d in doubles.values())

            v2 = checkpoint(tmp_path, "v2")
            await manager.update(PolicyUpdate(version="v2", weights={"path": v2}))
            for double in doubles.values():
                assert (double.weights, double.label, double.paused) == (v2, "v2", False), vars(double)
                assert double.calls[-4:] == ["pause", "reload", "reset prefix cache", "resume"], double.calls
            assert await _until(lambda: all(f"unload {BASE}@a1" in d.calls for d in doubles.values()))

            await manager.pause(30)
            assert all(d.paused for d in doubles.values())
            for double in doubles.values():
                double.weights = "pushed-v3"  # the trainer's own transfer
            await manager.update(PolicyUpdate(version="v3"))
            assert [(d.label, d.paused) for d in doubles.values()] == [("v3", False)] * 2
            assert [r.version for r in manager.state().replicas] == ["v3", "v3"]
            assert all(r.routed for r in manager.state().replicas)
        finally:
            await manager.close()
            await pool.aclose()

    asyncio.run(go())


async def _until(condition, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True
