"""The stack on a real two-node Ray cluster on this machine (`rollout-service ray up|scale|status|down`).

The test starts the cluster itself: a head node with the custom resource `node_a` and one CPU (the
embedded vLLM replica asks for both, so it lands there) and a worker node with `node_b` (refenv
and the service ask for it). Oracles: Ray's own view of its nodes (which node holds which
resource), the env's own counters and processes seen from outside (/proc), never the deployment's
bookkeeping alone. Bounded in time: each command and wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
from helpers import assert_accounted, assert_env_accounted, cli, unclaimed_ports, wait_until

from rollout_service.keys import read_key_file
from rollout_service.launch import embedded_model
from rollout_service.launch.stack import free_port, port_in_use
from rollout_service.trainer.client import RequestRejected, RolloutClient

pytest.importorskip("ray", reason="ray is not installed (the `ray` extra; `make test` installs it)")

# The whole module: its set-up (the Ray cluster and its own vLLM) took 82 s alone and 434 s beside other
# tests, and it is shared by its tests, so they all run in the `alone` unit (see tests/shared_vllm.py).
pytestmark = pytest.mark.alone

SAMPLING = {"temperature": 0.8, "max_tokens": 24}
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_cluster():
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "RAY_TMPDIR": temp, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    address = f"127.0.0.1:{free_port()}"

    def ports() -> list[str]:
        # Every port a node binds, chosen free: another Ray on this machine (a developer's, or a
        # local one a script started) holds the defaults (client server 10001, agent 52365).
        names = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc")
        names += ("runtime-env-agent", "metrics-export")
        return [f"--{name}-port={free_port()}" for name in names]

    common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    head = [RAY, "start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=1", '--resources={"node_a": 1}']
    head += ["--min-worker-port=30000", "--max-worker-port=30999", "--include-dashboard=false", *common]
    head += [f"--ray-client-server-port={free_port()}", *ports()]
    worker = [RAY, "start", f"--address={address}", "--num-cpus=2", '--resources={"node_b": 1}']
    worker += ["--min-worker-port=31000", "--max-worker-port=31999", *common, *ports()]
    try:
        for cmd in (head, worker):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        yield address, env
    finally:
        stop_cluster(temp, address)
        shutil.rmtree(temp, ignore_errors=True)


def stop_cluster(temp: str, address: str) -> None:
    """Stop this test's Ray nodes only (`ray stop` would stop every Ray on the machine, a developer's
    own cluster too): the processes that name its temp folder or its GCS port, and their descendants;
    TERM, then KILL what is left."""

    gcs_port = re.compile(rf":{address.rsplit(':', 1)[1]}\b")  # the client server names the node's own IP

    def ours() -> list[int]:
        named, parents = set(), {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid() or process_gone(int(entry.name)):
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if temp in cmdline or gcs_port.search(cmdline):
                named.add(int(entry.name))
        # With their descendants: the agents a raylet starts rename themselves (ray::DashboardAgent).
        while grown := {pid for pid, parent in parents.items() if parent in named} - named:
            named |= grown
        return sorted(named)

    for sig, grace_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 20)):
        for pid in ours():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        if wait_until(lambda: not ours(), grace_s, every_s=0.5):
            return


def ray_cli(address: str, env: dict, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return cli("ray", *args, "--address", address, timeout=timeout, env=env)


def node_resources(address: str, env: dict) -> dict[str, dict]:
    """Ray's own view: each node's resources, by node id (a driver of its own, in a child process)."""
    code = (
        "import json, os, ray; ray.init(address=os.environ['RAY_ADDRESS'], logging_level=40, log_to_driver=False); "
        "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))"
    )
    env = {**env, "RAY_ADDRESS": address}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie has released everything; only its exit status is left


class Deployment:
    def __init__(self, address: str, env: dict, config: Path) -> None:
        self.address, self.env, self.config = address, env, config

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return ray_cli(self.address, self.env, *args, "--config", str(self.config), timeout=timeout)

    def status(self) -> dict[str, dict]:
        done = self.run("status", timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return {p["name"]: p for p in json.loads(done.stdout)["pieces"]}

    @property
    def service(self) -> str:
        return self.status()["service-0"]["url"]


@pytest.fixture(scope="module")
def deployment(ray_cluster, tmp_path_factory):
    address, env = ray_cluster
    folder = tmp_path_factory.mktemp("cluster")
    replica, envs, service = unclaimed_ports(1), unclaimed_ports(3), unclaimed_ports(1)
    config = folder / "cluster.yaml"
    keys_file = f"{folder}/keys/{{namespace}}.keys"  # `ray up` fills in the namespace
    config.write_text(
        f"""
namespace: test-{random.randrange(1 << 30):x}
model: {embedded_model.MODEL_NAME}
logs_dir: {folder / "logs"}
replicas: {{count: 1, port: {replica}, num_cpus: 1, resources: {{node_a: 1}}, kv_cache_gib: 1}}
envs: {{count: 1, port: {envs}, pool: 2, num_cpus: 0, resources: {{node_b: 0.1}}, max_restarts: 3}}
service: {{port: {service}, num_cpus: 0, resources: {{node_b: 0.1}}, keys_file: "{keys_file}"}}
"""
    )
    deployed = Deployment(address, env, config)
    up = deployed.run("up")
    try:
        assert up.returncode == 0, up.stderr[-4000:]
        deployed.up = json.loads(up.stdout)
        # No key in the config: `up` generated both where the trainer reads them.
        (deployed.keys_file,) = (folder / "keys").iterdir()
        assert str(deployed.keys_file) in up.stderr and deployed.keys_file.stat().st_mode & 0o777 == 0o600
        deployed.keys = read_key_file(deployed.keys_file)
        # The tests ask as operators: the admin key reads the data plane too.
        deployed.headers = {"Authorization": f"Bearer {deployed.keys['ROLLOUT_ADMIN_KEY']}"}
        yield deployed
    finally:
        deployed.run("down", timeout=300)


def post_group(service: str, body: dict, headers: dict, timeout: float = 300) -> dict:
    answer = httpx.post(f"{service}/groups", json=body, headers=headers, timeout=timeout)
    assert answer.status_code == 200, answer.text
    group = answer.json()
    assert_accounted(group)
    return group


def test_up_places_each_piece_on_its_node_and_groups_score(deployment):
    pieces = {p["name"]: p for p in deployment.up["pieces"]}
    assert set(pieces) == {"replica-0", "env-0", "service-0"}
    assert all(p["alive"] and p["healthy"] for p in pieces.values()), pieces
    nodes = node_resources(deployment.address, deployment.env)
    assert "node_a" in nodes[pieces["replica-0"]["node_id"]], "the replica asked for node_a"
    assert "node_b" in nodes[pieces["env-0"]["node_id"]] and "node_b" in nodes[pieces["service-0"]["node_id"]]
    service = pieces["service-0"]["url"]
    group = post_group(service, {"task_id": "t001", "n": 2, "sampling": SAMPLING}, deployment.headers)
    assert group["counts"]["scored"] == 2 and group["env"]["urls"] == [pieces["env-0"]["url"]]
    assert {t["endpoint"] for a in group["attempts"] for t in a["turns"]} == {pieces["replica-0"]["url"]}
    # With no key in the config the service is keyed all the same (off loopback it would not start
    # otherwise): a trainer with the API key reads tasks and cannot change membership. Break tried:
    # _key_flags returning [] -> on a node whose address is not loopback the service refuses to start
    # and `up` fails (on a loopback node, the unkeyed POST below would answer).
    assert httpx.post(f"{service}/groups", json={"task_id": "t001"}, timeout=30).status_code == 401
    with RolloutClient(service, api_key=deployment.keys["ROLLOUT_API_KEY"], timeout_s=300) as trainer:
        assert trainer.tasks()
        with pytest.raises(RequestRejected) as refused:
            trainer.drain_env(pieces["env-0"]["url"])
        assert refused.value.status == 401
    # The env answers the service only: `up` gave both the deployment's token (issue #39 item 5).
    env_url = pieces["env-0"]["url"]
    assert httpx.get(f"{env_url}/tasks", timeout=10).status_code == 401
    assert httpx.post(f"{env_url}/step/reset", json={}, timeout=10).status_code == 401
    # The replica too (issue 46): it listens on the node's address, and its completions answer only the
    # holder of the deployment's key, which the service sends (the group above scored). Break tried:
    # no VLLM_API_KEY in the replica's environment (deploy._start) -> 200 here.
    replica = pieces["replica-0"]["url"]
    completion = {"model": embedded_model.MODEL_NAME, "prompt": "Hello", "max_tokens": 1}
    assert httpx.post(f"{replica}/v1/completions", json=completion, timeout=60).status_code == 401
    assert httpx.get(f"{replica}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    # Its logs and pid file are in a folder only this user can enter.
    logs = Path(pieces["env-0"]["log"]).parent
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700 and logs.stat().st_uid == os.geteuid()


def test_a_killed_env_is_restarted_by_ray_and_taken_back(deployment):
    """Break tried: the actor not exiting when its server dies (the watcher thread not started) ->
    Ray never restarts it and the env stays down (fails at `restarted`)."""
    before = deployment.status()
    env, service = before["env-0"], before["service-0"]["url"]
    answers: list[dict] = []
    body = {"task_id": "t002", "n": 2, "retries": 0, "sampling": SAMPLING}
    group = threading.Thread(target=lambda: answers.append(post_group(service, body, deployment.headers)))
    group.start()
    try:
        assert wait_until(lambda: httpx.get(f"{env['url']}/health", timeout=5).json()["leased"] > 0, 60)
        os.kill(env["pid"], signal.SIGKILL)
    finally:
        group.join(300)
    kinds = [a["failure"]["kind"] if a["failure"] else a["status"] for a in answers[0]["attempts"]]
    assert all(a["status"] == "env_failure" for a in answers[0]["attempts"]), kinds  # both were in flight

    def restarted() -> bool:
        now = deployment.status()["env-0"]
        return now.get("healthy", False) and now["pid"] != env["pid"]

    assert wait_until(restarted, 120, every_s=2), "restarted"

    def taken_back() -> bool:
        detail = httpx.get(f"{service}/health/detail", headers=deployment.headers, timeout=10).json()
        return all(e["ok"] for e in detail["envs"]) and detail["status"] == "ok"

    assert wait_until(taken_back, 60, every_s=1)
    again = post_group(service, {"task_id": "t003", "n": 2, "sampling": SAMPLING}, deployment.headers)
    assert again["counts"]["scored"] == 2
    detail = httpx.get(f"{service}/health/detail", headers=deployment.headers, timeout=10).json()
    assert [e["held"] for e in detail["envs"]] == [0], "a world slot leaked"
    health = httpx.get(f"{env['url']}/health", timeout=10).json()
    assert health["leased"] == 0
    assert_env_accounted(health)


def test_scaling_envs_up_and_down_while_groups_run_loses_nothing(deployment):
    """Break tried: scale stopping an env's actor without taking it out of the service first (no
    POST /envs/remove) -> the attempts on it end env_failure (fails at `nothing lost`)."""
    service = deployment.service
    groups = [{"task_id": f"t01{i}", "n": 2, "retries": 0, "sampling": SAMPLING} for i in range(4)]
    lines: list[dict] = []

    def batch() -> None:
        with httpx.stream(
            "POST", f"{service}/groups/batch", json={"groups": groups}, headers=deployment.headers, timeout=600
        ) as answer:
            lines.extend(json.loads(line) for line in answer.iter_lines() if line.strip())

    runner = threading.Thread(target=batch)
    runner.start()
    try:
        up = deployment.run("scale", "--envs", "2", timeout=300)
        assert up.returncode == 0, up.stderr[-3000:]
        envs = httpx.get(f"{service}/envs", headers=deployment.headers, timeout=10).json()
        assert len(envs) == 2 and all(e["pool"] == 2 for e in envs)
        added = deployment.status()["env-1"]["url"]
        down = deployment.run("scale", "--envs", "1", timeout=600)
        assert down.returncode == 0, down.stderr[-3000:]
        listed = httpx.get(f"{service}/envs", headers=deployment.headers, timeout=10).json()
        assert [e["url"] for e in listed] != [added]
    finally:
        runner.join(600)
    assert len(lines) == 4 and all("group" in line for line in lines), lines
    for line in lines:
        assert_accounted(line["group"])
        assert line["group"]["counts"]["scored"] == 2, line["group"]["attempts"]  # nothing lost, nothing cut short
    assert "env-1" not in deployment.status()
    (left,) = httpx.get(f"{service}/health/detail", headers=deployment.headers, timeout=10).json()["envs"]
    assert left["max_held"] <= left["pool"] and left["held"] == 0


def test_down_leaves_no_process_of_the_stack(deployment):
    """Break tried: down skipping the replicas -> the vLLM actor and its server live on (fails at the
    /proc check)."""
    pieces = deployment.status()
    pids = [p[key] for p in pieces.values() for key in ("pid", "actor_pid") if p.get(key)]
    assert len(pids) == 6, pieces
    done = deployment.run("down", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert wait_until(lambda: all(process_gone(pid) for pid in pids), 60), [p for p in pids if not process_gone(p)]
    assert deployment.status() == {}
    assert not any(port_in_use(int(p["url"].rsplit(":", 1)[1])) for p in pieces.values())


def test_a_wrong_config_is_refused_field_by_field_before_anything_starts(tmp_path):
    """No cluster needed: the file is checked first. Each wrong field is named, with no traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "envs: {count: 2, command: [x, '{hots}'], resources: {CPU: 1}, num_cpus: .inf}\n"
        "replicas: {kv_cache_gib: 0}\nservice: {command: [x]}\nunknown: 1\n"
    )
    done = cli("ray", "up", "--config", str(bad), "--address", "127.0.0.1:1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for field in ("envs.command", "envs.num_cpus", "envs.resources", "replicas.kv_cache_gib", "service.command"):
        assert field in done.stderr, (field, done.stderr)
    assert "unknown" in done.stderr
    ports = tmp_path / "ports.yaml"
    ports.write_text("envs: {count: 3, port: 65534}\n")
    done = cli("ray", "status", "--config", str(ports))
    assert done.returncode == 2 and "65535" in done.stderr, done.stderr
    overlap = tmp_path / "overlap.yaml"
    overlap.write_text("replicas: {count: 2, port: 8089}\n")  # 8089-8090: the envs' 8090
    done = cli("ray", "status", "--config", str(overlap))
    assert done.returncode == 2 and "overlap" in done.stderr, done.stderr
    missing = cli("ray", "status", "--config", str(tmp_path / "none.yaml"))
    assert missing.returncode == 2 and "none.yaml" in missing.stderr and "Traceback" not in missing.stderr
