"""Faults with real processes: envs and vLLM killed and restarted, deadlines, shutdown, many trainers.

Every test ends by checking the invariants: the pool was never exceeded (`max_leased`), no
world is leased, scheduled = scored + failed, and the service answered /health throughout.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from helpers import assert_accounted, cli, unclaimed_ports, wait_until

from rollout_service.launch.stack import ManagedProcess, start_embedded_vllm

SAMPLING = {"temperature": 0.8, "max_tokens": 24}


class Background:
    """POST a group from a thread; keep the response (or the exception)."""

    def __init__(self, url: str, body: dict, timeout: float = 300) -> None:
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body, timeout), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict, timeout: float) -> None:
        try:
            self.response = httpx.post(f"{url}/groups", json=body, timeout=timeout)
        except Exception as exc:
            self.error = exc

    def join(self, timeout: float = 300) -> Background:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the group did not come back"
        return self


def test_env_killed_mid_group_and_restarted(start_refenv, start_service):
    port = unclaimed_ports()  # the env restarts on it
    env = start_refenv("--pool", "4", "--latency-ms", "1500", port=port)
    service = start_service([env.url])
    running = Background(service.url, {"task_id": "t005", "n": 4, "retries": 1, "sampling": SAMPLING})
    assert wait_until(lambda: env.health()["leased"] == 4, 60)
    env.proc.proc.kill()  # SIGKILL: no goodbye
    env.proc.proc.wait(10)
    assert wait_until(lambda: httpx.get(f"{service.url}/health").json()["status"] == "degraded", 10)
    group = running.join().response.json()
    assert_accounted(group)
    assert group["counts"]["failed"] >= 1
    assert all(a["status"] in ("scored", "env_failure") for a in group["attempts"])
    env = start_refenv("--pool", "4", port=port)
    assert wait_until(lambda: httpx.get(f"{service.url}/health").json()["status"] == "ok", 10)
    again = httpx.post(
        f"{service.url}/groups", timeout=300, json={"task_id": "t005", "n": 2, "sampling": SAMPLING}
    ).json()
    assert_accounted(again)
    assert again["counts"]["scored"] == 2
    health = env.health()
    assert health["leased"] == 0 and health["max_leased"] <= 4


def test_sigterm_abandons_running_groups(start_refenv, start_service):
    env = start_refenv("--pool", "4", "--latency-ms", "30000")
    service = start_service([env.url])
    running = Background(service.url, {"task_id": "t005", "n": 4, "sampling": SAMPLING})
    assert wait_until(lambda: env.health()["leased"] == 4, 60)
    os.kill(service.proc.proc.pid, signal.SIGTERM)
    assert wait_until(lambda: env.health()["leased"] == 0, 10)  # 30 s (the env's latency) when broken
    running.join(30)
    assert running.response is not None and running.response.status_code == 503
    assert running.response.json()["error"] == "shutting_down"
    service.proc.proc.wait(30)
    # uvicorn re-raises the signal it handled once shutdown is complete: -SIGTERM is a clean exit.
    assert service.proc.proc.returncode in (0, -signal.SIGTERM)
    assert "Traceback" not in service.proc.log_path.read_text()
    assert env.health()["episodes"]["abandoned"] == 4


def test_many_trainers_beyond_the_pool_all_queue_nothing_refused(start_refenv, start_service):
    env = start_refenv("--pool", "2")
    service = start_service([env.url])
    trainers = [
        Background(service.url, {"task_id": t, "n": 2, "max_turns": 2, "sampling": SAMPLING})
        for t in ("t001", "t002", "t004", "t019", "t020")
    ]
    saw_waiting = wait_until(
        lambda: httpx.get(f"{service.url}/health/detail").json()["attempts_waiting_for_a_world"] > 0, 30
    )
    groups = [t.join().response for t in trainers]
    assert saw_waiting
    assert all(r.status_code == 200 for r in groups)
    for r in groups:
        assert_accounted(r.json())
    health = env.health()
    assert health["max_leased"] == 2 and health["leased"] == 0


def test_inference_deadline_marks_inference_failure(start_refenv, start_service, launch):
    """A completion slower than --inference-timeout fails its attempt as inference_timeout and its
    episode is abandoned. The model is the scripted stand-in answering after 3 s against a 0.5 s
    deadline, so the timing is certain (a CPU vLLM being slower than the deadline is not): 10 s against
    a 0.5 s deadline, so a loaded machine does not decide it."""
    from scripted_model import command

    model = launch("model", None, command(0, "answer", "--delay", "10"), ready_path="/v1/models")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], "--inference-timeout", "0.5", vllm=model.url, model="scripted")
    sent = time.monotonic()
    group = httpx.post(
        f"{service.url}/groups",
        timeout=120,
        json={"task_id": "t005", "n": 2, "retries": 0, "sampling": {"temperature": 0.8, "max_tokens": 400}},
    ).json()
    assert time.monotonic() - sent < 8.0  # given up before the model answered
    assert_accounted(group)
    assert [a["status"] for a in group["attempts"]] == ["inference_failure"] * 2
    assert all(a["failure"]["kind"] == "inference_timeout" for a in group["attempts"])
    # How late the deadline struck, without the env's and the machine's share of the wall time.
    assert all(a["timings"]["inference_s"] < 3.0 for a in group["attempts"]), group["attempts"]
    assert httpx.get(f"{model.url}/stats").json()["requests"] == 2  # one completion asked per attempt
    assert wait_until(lambda: env.health()["leased"] == 0, 3)
    assert env.health()["episodes"]["abandoned"] == 2


@pytest.fixture
def own_vllm(logs_dir):
    """A second vLLM server for this test alone, so killing it leaves the session's alone."""
    port = unclaimed_ports()  # known before it starts, and it restarts on it
    procs: list[ManagedProcess] = []

    def start() -> ManagedProcess:
        name = f"vllm-own-{len(procs)}"
        procs.append(start_embedded_vllm(port, logs_dir / f"{name}.log", name=name, kv_cache_gib=1, eager=True))
        return procs[-1]

    yield f"http://127.0.0.1:{port}", start
    for proc in procs:
        proc.stop()


@pytest.mark.alone  # two start-ups of its own vLLM: beside other tests they took over 600 s
def test_vllm_killed_mid_group_and_restarted(start_refenv, start_service, own_vllm):
    url, start_vllm = own_vllm
    vllm = start_vllm()
    env = start_refenv("--pool", "4")
    svc = start_service([env.url], vllm=url).url
    running = Background(
        svc, {"task_id": "t005", "n": 4, "retries": 0, "sampling": {"temperature": 0.8, "max_tokens": 400}}
    )
    assert wait_until(lambda: env.health()["leased"] == 4, 60)
    # Kill it while completions are in flight on it (the service's own count of requests out).
    assert wait_until(lambda: httpx.get(f"{svc}/health/detail").json()["models"][0]["outstanding"] > 0, 60)
    vllm.stop(grace_s=0)
    group = running.join().response.json()
    assert_accounted(group)
    failed = [a for a in group["attempts"] if a["status"] == "inference_failure"]
    assert failed and all(a["failure"]["kind"] in ("inference_unreachable", "inference_server_error") for a in failed)
    assert wait_until(lambda: env.health()["leased"] == 0, 3)
    assert wait_until(lambda: httpx.get(f"{svc}/health").json()["status"] == "degraded", 10)
    health = httpx.get(f"{svc}/health/detail").json()
    assert not health["models"][0]["ok"] and "unreachable" in health["models"][0]["error"]
    start_vllm()  # back on the same port; the service recovers without a restart of its own
    assert wait_until(lambda: httpx.get(f"{svc}/health").json()["status"] == "ok", 10)
    again = httpx.post(f"{svc}/groups", timeout=300, json={"task_id": "t005", "n": 2, "sampling": SAMPLING}).json()
    assert again["counts"]["scored"] == 2
    assert env.health()["leased"] == 0 and env.health()["max_leased"] <= 4


def test_loadtest_reports_and_plots(start_refenv, start_service, tmp_path):
    env = start_refenv("--pool", "4")
    service = start_service([env.url])
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    done = cli(
        "loadtest",
        "--service",
        service.url,
        "--trainers",
        "2",
        "--batch",
        "2",
        "--n",
        "2",
        "--count",
        "4",
        "--max-tokens",
        "16",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["groups"] == 4 and report["attempts"] == 8 and report["error_count"] == 0
    assert set(report["group_latency_s"]) == {"p50", "p90", "p99", "max"}
    e = report["envs"][env.url]
    assert e["max_leased_env"] <= 4 and e["leased_at_end"] == 0 and 0 < e["utilisation_service"] <= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "groups/s" in done.stdout
    remote = cli("loadtest", "--service", "http://10.1.2.3:8080", "--count", "1", timeout=60)
    assert remote.returncode == 2 and "loopback" in remote.stderr
