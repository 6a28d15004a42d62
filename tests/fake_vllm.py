"""An in-process stand-in for a fleet of vLLM replicas, over httpx's MockTransport.

It serves the routes the service uses to change and watch the policy (LoRA load/unload, pause,
resume, is_paused, collective_rpc reload_weights, reset_prefix_cache, weight_checker, update_weight_version,
weight_info, /v1/models) and chat completions whose answer says which weights generated them.
It exists for what a real vLLM cannot be made to do on demand: fail a reload half-way, refuse a
resume, go down and come back restarted on its launch checkpoint between two probes. Its own
state (weights, label, adapters, paused, the log of calls) is the oracle the tests check.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from httpx_stand_in import stand_in

from rollout_service.backends.replica_pool import ReplicaPool
from rollout_service.server.metrics import Metrics
from rollout_service.server.policy.manager import PolicyManager

BASE = "m"
LAUNCH_WEIGHTS = "ckpt0"


class Replica:
    """One vLLM server. `weights` is what generates tokens; `label` is what /weight_info says."""

    def __init__(self, url: str, weights: str = LAUNCH_WEIGHTS) -> None:
        self.url = url
        self.weights = weights
        self.label = "default"
        self.adapters: dict[str, str] = {}
        self.paused = False
        self.up = True
        self.reload_delay = 0.0
        self.reload_fail: str | None = None  # "half": weights changed, then 500; "clean": 500, unchanged
        self.resume_fail = 0  # how many /resume calls answer 500
        self.chat_delay = 0.0
        self.log: list[tuple[str, dict]] = []  # (path, body) of every call it answered
        self.cache_resets = 0  # POST /reset_prefix_cache calls
        self._resumed = asyncio.Event()
        self._resumed.set()

    def restart(self, weights: str = LAUNCH_WEIGHTS) -> None:
        """The process came back: launch weights, no label, no adapters, not paused."""
        self.weights, self.label, self.adapters, self.paused = weights, "default", {}, False
        self._resumed.set()

    def calls(self, path: str) -> list[dict]:
        return [body for p, body in self.log if p == path]

    def chats(self) -> list[dict]:
        return self.calls("/v1/chat/completions")

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.log.append((path, body))
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": BASE}] + [{"id": a} for a in self.adapters]})
        if path == "/v1/load_lora_adapter":
            self.adapters[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body["lora_name"], None) is None:
                return httpx.Response(404, json={"error": {"message": "cannot be found"}})
            return httpx.Response(200, text="ok")
        if path == "/pause":
            self.paused = True
            self._resumed.clear()
            return httpx.Response(200, json={})
        if path == "/resume":
            if self.resume_fail:
                self.resume_fail -= 1
                return httpx.Response(500, json={"error": {"message": "resume broke"}})
            self.paused = False
            self._resumed.set()
            return httpx.Response(200, json={})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/collective_rpc":
            await asyncio.sleep(self.reload_delay)
            target = body["kwargs"]["weights_path"]
            if self.reload_fail == "half":
                self.weights = target + "-HALF"
                return httpx.Response(500, json={"error": {"message": "out of memory half-way"}})
            if self.reload_fail == "clean":
                return httpx.Response(500, json={"error": {"message": "out of memory"}})
            self.weights = target
            return httpx.Response(200, json={"results": []})
        if path == "/reset_prefix_cache":
            self.cache_resets += 1
            return httpx.Response(200, json={"success": True})
        if path == "/weight_checker":
            return httpx.Response(200, json={"checksums": {"all": self.weights}})
        if path == "/update_weight_version":
            self.label = body["new_version"]
            return httpx.Response(200, json={})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/v1/chat/completions":
            return await self._chat(body)
        return httpx.Response(404, text="Not Found")

    async def _chat(self, body: dict) -> httpx.Response:
        model = body["model"]
        if model != BASE and model not in self.adapters:
            return httpx.Response(404, json={"error": {"message": f"The model `{model}` does not exist."}})
        await self._resumed.wait()  # a paused server holds the request (mode=keep)
        first = self.weights
        await asyncio.sleep(self.chat_delay)
        await self._resumed.wait()
        made_by = first if first == self.weights else f"{first}->{self.weights}"
        if model != BASE:
            made_by += f"+{self.adapters.get(model)}"
        answer = {
            "choices": [
                {
                    "index": 0,
                    "message": {"content": json.dumps({"action": "answer", "input": made_by})},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3},
        }
        return httpx.Response(200, json=answer)


def made_by(completion: str) -> str:
    """What weights (and adapter) the fake says generated a completion."""
    return json.loads(completion)["input"]


class Fleet:
    """Replicas http://r0, http://r1, ...; `on_chat` may answer a chat request instead of them."""

    def __init__(self, n: int = 2) -> None:
        self.replicas = {f"http://r{i}": Replica(f"http://r{i}") for i in range(n)}
        self.on_chat: Callable[[httpx.Request], Awaitable[httpx.Response | None]] | None = None

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[f"http://r{i}"]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.on_chat is not None and request.url.path == "/v1/chat/completions":
            answer = await self.on_chat(request)
            if answer is not None:
                return answer
        return await self.replicas[f"{request.url.scheme}://{request.url.host}"].handle(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    @property
    def paused(self) -> list[bool]:
        return [r.paused for r in self.replicas.values()]

    async def chat_client(self) -> ReplicaPool:
        return ReplicaPool(
            list(self.replicas), timeout_s=30.0, token_ids=False, http=stand_in(self.transport(), timeout_s=30.0)
        )


async def make_manager(n: int = 2, fleet: Fleet | None = None) -> tuple[Fleet, ReplicaPool, PolicyManager]:
    """A started PolicyManager over a fake fleet (a new one unless given)."""
    fleet = fleet or Fleet(n)
    chat = await fleet.chat_client()
    manager = PolicyManager(chat, BASE, Metrics())
    await manager.start()
    return fleet, chat, manager


def checkpoint(root: Path, name: str) -> str:
    """A folder the service accepts as a full-weight checkpoint (the fake loads its name)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_text("")
    return str(folder)


def adapter(root: Path, name: str) -> str:
    """A folder the service accepts as a LoRA adapter (the fake loads its name)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_text("")
    return str(folder)
