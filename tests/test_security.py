"""Safe by default (issue #39, items 5-12): each hole an attacker found is refused, and each test here
was seen failing on the code that had the hole."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers import cli, wait_until

from rollout_service.cluster import actors
from rollout_service.cluster.actors import default_logs_dir, private_folder
from rollout_service.launch.stack import ManagedProcess
from rollout_service.server.groups.run_log import RunLog

# -- run logs: private, and never written through a link (item 9) ----------------------------------


@pytest.fixture
def open_umask():
    """A umask that lets anything through: what the files get is then the code's doing alone."""
    old = os.umask(0)
    yield
    os.umask(old)


def write_groups(log: RunLog, *lines: bytes) -> None:
    async def run() -> None:
        log.start()
        for line in lines:
            log.append(line)
        await log.close()

    asyncio.run(run())


def test_run_logs_are_0600_in_a_0700_folder(tmp_path, open_umask):
    runs = tmp_path / "runs"
    log = RunLog(runs, "r1")
    write_groups(log, b'{"group": 1}')
    assert log.groups_written == 1, log.error
    assert stat.S_IMODE(runs.stat().st_mode) == 0o700
    assert stat.S_IMODE(log.path.stat().st_mode) == 0o600


def test_a_run_log_left_open_to_others_is_closed_before_it_is_written(tmp_path, open_umask):
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o777)
    (runs / "r1.jsonl").write_text('{"old": 1}\n')
    (runs / "r1.jsonl").chmod(0o666)
    log = RunLog(runs, "r1")
    write_groups(log, b'{"group": 2}')
    assert stat.S_IMODE(runs.stat().st_mode) == 0o700
    assert stat.S_IMODE(log.path.stat().st_mode) == 0o600
    assert log.path.read_text() == '{"old": 1}\n{"group": 2}\n'


def test_a_symlink_planted_as_the_run_log_is_never_followed(tmp_path):
    """Planted after the service started (between its start check and a write): the write fails, the
    group is counted lost (/health shows it), and the link's target is untouched, not truncated."""
    victim = tmp_path / "victim"
    victim.write_text("precious, no newline at the end")  # a torn tail the writer would cut off
    log = RunLog(tmp_path / "runs", "r1")
    log.path.symlink_to(victim)
    write_groups(log, b'{"group": 1}')
    assert victim.read_text() == "precious, no newline at the end"
    assert log.groups_written == 0 and log.groups_lost == 1 and log.error, log.error


def test_serve_refuses_a_run_log_that_is_a_symlink(tmp_path):
    """Found at start: exit 2 with a line that says why, before anything is written."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    (runs / "r1.jsonl").symlink_to(victim)
    done = cli(
        "serve", "--env", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9", "--model", "m",
        "--runs-dir", str(runs), "--run-id", "r1", "--startup-timeout", "1",
    )  # fmt: skip
    assert done.returncode == 2 and "symlink" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert victim.read_text() == "precious"


# -- every free string of a request is capped (item 12) ---------------------------------------------


@pytest.fixture
def scripted_service(start_refenv, start_service, start_scripted_model):
    """A real service and refenv; the model is the scripted stand-in: what is tested is what the
    service accepts, which is decided before any model is asked."""
    env = start_refenv("--pool", "2")
    model = start_scripted_model("answer")
    return start_service([env.url], vllm=model.url, model="scripted"), env


@pytest.mark.parametrize(
    ("sampling", "where", "words"),
    [
        ({"stop": ["x" * 3_000_000]}, "sampling.stop.0", "at most 200 characters"),
        ({"stop": ["</answer>", "y" * 201]}, "sampling.stop.1", "at most 200 characters"),
        ({"stop": [""]}, "sampling.stop.0", "at least 1 character"),
        ({"stop": ["s"] * 9}, "sampling.stop", "at most 8 items"),
    ],
)
def test_stop_strings_are_capped_in_length_and_count(scripted_service, sampling, where, words):
    """A 3 MB stop string was accepted, sent with every turn and logged. Now: 422, naming the entry."""
    service, env = scripted_service
    r = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 1, "sampling": sampling}, timeout=60)
    assert r.status_code == 422, r.text[:300]
    body = r.json()
    assert body["error"] and where in body["message"] and words in body["message"], body["message"][:300]
    assert len(r.content) < 2000  # the refusal does not echo the string back
    assert env.health()["episodes"]["started"] == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("task_id", "t" * 201), ("slug", "s" * 301), ("model", "m" * 201), ("group_id", "g" * 201)],
)
def test_every_other_free_string_of_a_group_is_capped(scripted_service, field, value):
    service, env = scripted_service
    body = {"task_id": "t001", "n": 1, field: value}
    if field == "slug":
        del body["task_id"]
    r = httpx.post(f"{service.url}/groups", json=body, timeout=60)
    assert r.status_code == 422 and field in r.json()["message"] and "at most" in r.json()["message"], r.text[:300]


def test_a_group_with_an_honest_stop_string_runs(scripted_service):
    service, env = scripted_service
    r = httpx.post(
        f"{service.url}/groups",
        json={"task_id": "t001", "n": 1, "sampling": {"stop": ["</answer>", "z" * 200]}},
        timeout=120,
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["counts"]["scheduled"] == 1


# -- refenv: episodes only their driver can reach (item 5) -------------------------------------------

TOKEN = "t0ken-for-the-test-" + "x" * 16


def test_a_third_party_cannot_guess_another_drivers_episode(start_refenv):
    """Ids were `step-N`, with N in /health: a stranger's POST /step or DELETE drove or ended another
    driver's episode. Every id a stranger can derive from what refenv publishes is now unknown (410)."""
    env = start_refenv("--pool", "3")
    ids = [httpx.post(f"{env.url}/step/reset", json={}, timeout=30).json()["episode_id"] for _ in range(3)]
    health = env.health()
    assert health["episodes"]["started"] == 3
    for n in range(0, health["episodes"]["started"] + 10):
        for guess in (f"step-{n}", str(n)):
            r = httpx.post(f"{env.url}/step", json={"episode_id": guess, "completion": "{}"}, timeout=30)
            assert r.status_code == 410, (guess, r.status_code, r.text[:200])
            assert httpx.delete(f"{env.url}/step/{guess}", timeout=30).status_code == 410
    assert env.health()["episodes"]["abandoned"] == 0 and env.health()["live_episodes"] == 3
    published = json.dumps(env.health())
    assert not any(eid.removeprefix("step-") in published for eid in ids), published
    # Not a counter in disguise: the ids share no prefix beyond the contract's `step-`, and are long.
    suffixes = [eid.removeprefix("step-") for eid in ids]
    assert all(eid.startswith("step-") and len(s) >= 20 for eid, s in zip(ids, suffixes, strict=True)), ids
    assert len({s[:4] for s in suffixes}) == 3, ids
    for eid in ids:
        assert httpx.delete(f"{env.url}/step/{eid}", timeout=30).status_code == 200


def test_refenv_with_a_token_answers_only_its_holder(start_refenv):
    env = start_refenv("--pool", "1", "--token", TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    wrong = {"Authorization": "Bearer " + "y" * len(TOKEN)}
    # /health stays open (an orchestrator's probe), and shows counts, never ids.
    assert httpx.get(f"{env.url}/health", timeout=10).status_code == 200
    for headers in ({}, wrong, {"Authorization": TOKEN}):
        for method, path, body in (
            ("GET", "/tasks", None),
            ("POST", "/step/reset", {}),
            ("POST", "/step", {"episode_id": "step-1", "completion": "{}"}),
            ("DELETE", "/step/step-1", None),
        ):
            r = httpx.request(method, f"{env.url}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", (method, path, r.text[:200])
    assert env.health()["episodes"]["started"] == 0
    reset = httpx.post(f"{env.url}/step/reset", json={}, headers=auth, timeout=30)
    assert reset.status_code == 200, reset.text[:200]
    eid = reset.json()["episode_id"]
    assert httpx.post(f"{env.url}/step", json={"episode_id": eid, "completion": "{}"}, timeout=30).status_code == 401
    assert httpx.delete(f"{env.url}/step/{eid}", headers=wrong, timeout=30).status_code == 401
    assert httpx.delete(f"{env.url}/step/{eid}", headers=auth, timeout=30).status_code == 200
    assert eid not in httpx.get(f"{env.url}/health", timeout=10).text


def test_refenv_refuses_a_short_token(start_refenv):
    done = subprocess.run(
        [sys.executable, "-m", "refenv.cli", "serve", "--step", "--token", "short", "--listen", "127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "token" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_service_sends_the_envs_token(start_refenv, start_service, start_scripted_model):
    """Real service, real refenv with --token, scripted model: groups score only when the service
    holds the env's token (--env-token-env); without it, the service does not start on that env."""
    env = start_refenv("--pool", "2", "--token", TOKEN)
    model = start_scripted_model("answer")
    service = start_service(
        [env.url], "--env-token-env", "TEST_ENV_TOKEN", env={"TEST_ENV_TOKEN": TOKEN}, vllm=model.url, model="scripted"
    )
    group = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 2}, timeout=120).json()
    assert group["counts"]["scored"] == 2, group["counts"]
    health = env.health()
    assert health["episodes"]["finished"] == 2 and health["live_episodes"] == 0, health["episodes"]
    refused = start_service([env.url], "--startup-timeout", "5", wait=False, vllm=model.url, model="scripted")
    assert refused.proc.proc.wait(120) != 0
    assert "401" in refused.proc.log_path.read_text() or "unauthorized" in refused.proc.log_path.read_text()


class _EnvStandIn(BaseHTTPRequestHandler):
    """Records every (path, Authorization) it is sent. Under /notenv/ it is no env (404); /notready/ an
    env not ready yet; /nostep/ a ready env without step mode; /good/ a ready step env serving no task."""

    seen: list[tuple[str, str | None]]
    HEALTH = {"status": "ready", "workers": 1, "capabilities": {"drive_modes": ["step"]}}

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        health = dict(self.HEALTH)
        if self.path == "/notready/health":
            health["status"] = "starting"
        elif self.path == "/nostep/health":
            health["capabilities"] = {"drive_modes": ["hosted"]}
        elif self.path == "/good/tasks":
            health = {"tasks": []}
        elif self.path not in ("/good/health",):
            self._answer(404, {"error": "not_found", "message": "no such page"})
            return
        self._answer(200, health)

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_the_envs_token_goes_only_to_an_env_whose_health_was_accepted(
    start_refenv, start_service, start_scripted_model
):
    """POST /envs of URLs that are no env, not ready, not in step mode: none is sent the env's token;
    an env whose /health passed gets it from its next call on (/tasks). The oracle: a stand-in env
    recording the headers it was sent (a real env would not say). Break tried: the token on every call
    from the first (the old EnvClient) -> the /health probes carried it, fails."""
    seen: list[tuple[str, str | None]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("EnvStandIn", (_EnvStandIn,), {"seen": seen}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = start_refenv("--pool", "2", "--token", TOKEN)
        model = start_scripted_model("answer")
        service = start_service(
            [env.url],
            "--env-token-env",
            "TEST_ENV_TOKEN",
            env={"TEST_ENV_TOKEN": TOKEN},
            vllm=model.url,
            model="scripted",
        )
        stand_in = f"http://127.0.0.1:{server.server_port}"
        expected = {"notenv": (422, "env_refused"), "notready": (504, "env_not_ready"), "nostep": (422, "env_refused")}
        expected["good"] = (422, "env_refused")  # it serves no task: refused after /tasks
        for name, (status, error) in expected.items():
            r = httpx.post(f"{service.url}/envs", json={"url": f"{stand_in}/{name}", "timeout_s": 3}, timeout=60)
            assert (r.status_code, r.json()["error"]) == (status, error), (name, r.text)
        with_token = sorted({path for path, auth in seen if auth is not None})
        assert with_token == ["/good/tasks"], seen
        assert ("/good/tasks", f"Bearer {TOKEN}") in seen and ("/nostep/tasks", None) not in seen, seen
        assert {path for path, _ in seen} >= {"/notenv/health", "/notready/health", "/nostep/health", "/good/health"}
    finally:
        server.shutdown()
        server.server_close()


def test_what_compose_wires_closes_the_env_with_a_generated_token(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """compose's pieces, run here as its files wire them (no Docker engine on this machine; the files
    themselves are checked in tests/test_docker_files.py): `rollout-service env-token FILE` with no
    ENV_TOKEN makes a token once and keeps it; refenv --token-file FILE answers only its holder; the
    service, given ENV_TOKEN from FILE.env, runs a group on it. An ENV_TOKEN a shell would misread is
    refused without being shown. Break tried: refenv without --token-file (the old compose: an empty
    REFENV_TOKEN) -> /tasks answered 200 to anyone, fails."""
    token_file = tmp_path / "env-token" / "token"
    quiet = {k: v for k, v in os.environ.items() if k != "ENV_TOKEN"}
    made = cli("env-token", str(token_file), env=quiet)
    assert made.returncode == 0, made.stderr
    token = token_file.read_text().strip()
    assert len(token) >= 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert cli("env-token", str(token_file), env=quiet).returncode == 0
    assert token_file.read_text().strip() == token  # kept: the envs and the service keep agreeing
    shell_line = (tmp_path / "env-token" / "token.env").read_text()
    assert shell_line == f"ENV_TOKEN={token}\n"
    bad = cli("env-token", str(token_file), env=quiet | {"ENV_TOKEN": "short; rm -rf x"})
    assert bad.returncode == 1 and "rm -rf" not in bad.stderr and "ENV_TOKEN" in bad.stderr, bad.stderr
    env = start_refenv("--pool", "2", "--token-file", str(token_file))
    assert httpx.get(f"{env.url}/tasks", timeout=10).status_code == 401  # closed to whoever lacks it
    model = start_scripted_model("answer")
    service = start_service(
        [env.url], "--env-token-env", "ENV_TOKEN", env={"ENV_TOKEN": token}, vllm=model.url, model="scripted"
    )
    group = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 2}, timeout=120).json()
    assert group["counts"]["scored"] == 2, group["counts"]
    assert env.health()["episodes"]["finished"] == 2


def test_refenv_refuses_a_token_file_it_cannot_use(tmp_path):
    short = tmp_path / "short"
    short.write_text("tiny\n")
    for path in (short, tmp_path / "missing"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "refenv.cli",
                "serve",
                "--step",
                "--token-file",
                str(path),
                "--listen",
                "127.0.0.1:9",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and "--token-file" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert "tiny" not in done.stderr


# -- checkpoint paths: checked, bounded, and telling nothing (item 8) -------------------------------

REFUSED_UNDER_ROOT = "is not a readable checkpoint under the checkpoint root"


def lora_folder(folder: Path) -> str:
    """A PEFT adapter's files (the scripted replicas load nothing from them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_text("")
    return str(folder)


def post_policy(service, **body) -> httpx.Response:
    return httpx.post(f"{service.url}/policy", json=body, timeout=60)


def test_a_lora_path_is_checked_like_a_checkpoint(start_refenv, start_service, start_scripted_model, tmp_path):
    """`"../../../../../etc"` went to vLLM as is (200). Now every LoRA folder must be an absolute path to
    a readable folder with adapter_config.json and safetensors, as a full checkpoint must; a refusal
    reaches no replica (the scripted replica's own count of loads is the oracle)."""
    env = start_refenv("--pool", "2")
    model = start_scripted_model("answer")
    service = start_service([env.url], vllm=model.url, model="scripted")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "adapter_config.json").write_text("{}")
    for path in ("../../../../../etc", "/etc", str(tmp_path / "missing"), str(tmp_path / "config-only")):
        r = post_policy(service, version="v-bad", lora={"path": path})
        assert r.status_code == 422 and r.json()["error"] == "checkpoint_refused", (path, r.text)
        assert "is not a readable checkpoint" in r.json()["message"], r.text
    assert httpx.get(f"{model.url}/stats", timeout=10).json()["loads_started"] == 0
    good = post_policy(service, version="v1", lora={"path": lora_folder(tmp_path / "v1")})
    assert good.status_code == 200 and policy_version(service) == "v1", good.text


def policy_version(service) -> str:
    return httpx.get(f"{service.url}/policy", timeout=10).json()["version"]


def test_the_checkpoint_root_bounds_both_kinds_after_resolving_symlinks(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    env = start_refenv("--pool", "2")
    model = start_scripted_model("answer")
    service = start_service([env.url], "--checkpoint-root", str(root), vllm=model.url, model="scripted")
    escaped = lora_folder(outside / "adapter")
    (root / "link").symlink_to(outside / "adapter")  # inside by name, outside once resolved
    (root / "up").symlink_to(outside)
    weights = outside / "ckpt"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_text("")
    refused = {
        "lora outside": {"lora": {"path": escaped}},
        "lora via a symlink": {"lora": {"path": str(root / "link")}},
        "lora via .. in the path": {"lora": {"path": f"{root}/../outside/adapter"}},
        "lora via a linked parent": {"lora": {"path": str(root / "up" / "adapter")}},
        "weights outside": {"weights": {"path": str(weights)}},
        "missing under the root": {"lora": {"path": str(root / "missing")}},
        "missing outside": {"lora": {"path": str(outside / "missing")}},
    }
    messages = {}
    for case, source in refused.items():
        r = post_policy(service, version="v-bad", **source)
        assert r.status_code == 422 and r.json()["error"] == "checkpoint_refused", (case, r.text)
        message = r.json()["message"]
        assert REFUSED_UNDER_ROOT in message, (case, message)
        if "lora" in source:
            messages[case] = message.split(REFUSED_UNDER_ROOT, 1)[1]
    assert len(set(messages.values())) == 1, messages  # existing or not, inside or out: the same words
    # A file of an adapter under the root that links out is outside too.
    leaky = Path(lora_folder(root / "leaky"))
    (leaky / "adapter_model.safetensors").unlink()
    (leaky / "adapter_model.safetensors").symlink_to(Path(escaped) / "adapter_model.safetensors")
    r = post_policy(service, version="v-bad", lora={"path": str(leaky)})
    assert r.status_code == 422 and REFUSED_UNDER_ROOT in r.json()["message"], r.text
    assert httpx.get(f"{model.url}/stats", timeout=10).json()["loads_started"] == 0
    inside = post_policy(service, version="v1", lora={"path": lora_folder(root / "adapters" / "v1")})
    assert inside.status_code == 200 and policy_version(service) == "v1", inside.text


def test_a_checkpoint_whose_files_link_out_of_the_root_is_refused_and_the_resolved_folder_is_loaded(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """Any file the engine reads, not only the config and *.safetensors: a *.bin, a tokenizer file, a
    file in a sub-folder, a linked sub-folder, each a link out of the root -> 422 checkpoint_refused
    and no load reaches the model server (its own count is the oracle). A folder reached through a
    link inside the root is loaded by its resolved path (what the model server was told, from its
    own record). Breaks tried: the old check (config and *.safetensors only) -> the *.bin, tokenizer
    and sub-folder links were accepted and loaded, fails; the path forwarded as given -> the server
    was told root/alias, fails; linked sub-folders inside the root not walked into -> the link out
    of the root behind one was accepted, fails."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"not yours")
    (outside / "folder").mkdir()
    env = start_refenv("--pool", "2")
    model = start_scripted_model("answer")
    service = start_service([env.url], "--checkpoint-root", str(root), vllm=model.url, model="scripted")
    leaks = {
        "a *.bin": "adapter_model.bin",
        "a tokenizer file": "tokenizer.json",
        "a file in a sub-folder": "sub/extra.bin",
        "a linked sub-folder": "shards",
    }
    for case, name in leaks.items():
        folder = Path(lora_folder(root / case.replace(" ", "-").replace("*", "")))
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(outside / ("folder" if name == "shards" else "secret.bin"))
        r = post_policy(service, version="v-bad", lora={"path": str(folder)})
        assert r.status_code == 422 and r.json()["error"] == "checkpoint_refused", (case, r.text)
        assert REFUSED_UNDER_ROOT in r.json()["message"], (case, r.text)
    # A sub-folder linked to a folder inside the root is walked too: a link out of the root in there
    # is read by the engine all the same.
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "extra.bin").symlink_to(outside / "secret.bin")
    folder = Path(lora_folder(root / "a-linked-sub-folder-inside-the-root"))
    (folder / "shards").symlink_to(elsewhere)
    r = post_policy(service, version="v-bad", lora={"path": str(folder)})
    assert r.status_code == 422 and r.json()["error"] == "checkpoint_refused", r.text
    weights = root / "weights-with-a-leak"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_text("")
    (weights / "pytorch_model.bin").symlink_to(outside / "secret.bin")
    r = post_policy(service, version="v-bad", weights={"path": str(weights)})
    assert r.status_code == 422 and r.json()["error"] == "checkpoint_refused", r.text
    stats = httpx.get(f"{model.url}/stats", timeout=10).json()
    assert stats["loads_started"] == 0, stats
    # Links that stay inside the root are fine; the model server is told where they lead.
    real = Path(lora_folder(root / "adapters" / "v1"))
    (real / "tokenizer.json").symlink_to(real / "adapter_config.json")
    (real / "again").symlink_to(real)  # a loop of links inside the root is no reason to refuse
    (root / "alias").symlink_to(real)
    r = post_policy(service, version="v1", lora={"path": str(root / "alias")})
    assert r.status_code == 200 and policy_version(service) == "v1", r.text
    loaded = httpx.get(f"{model.url}/stats", timeout=10).json()["adapters"]
    assert list(loaded.values()) == [str(real.resolve())], loaded


def test_serve_refuses_a_checkpoint_root_that_is_not_a_folder(tmp_path):
    done = cli(
        "serve", "--env", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9", "--model", "m",
        "--checkpoint-root", str(tmp_path / "nowhere"),
    )  # fmt: skip
    assert done.returncode == 2 and "--checkpoint-root" in done.stderr and "Traceback" not in done.stderr, done.stderr


# -- Ray: pid files in a private folder, and only the recorded process is killed (item 11) -----------


def test_the_default_ray_logs_folder_is_private_and_per_user(open_umask):
    folder = private_folder(default_logs_dir())
    assert str(os.geteuid()) in folder.name and folder.parent == Path(tempfile.gettempdir())
    info = folder.lstat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700


@pytest.mark.parametrize("planted", ["others may write", "a symlink", "owned by another user"])
def test_a_ray_logs_folder_someone_else_could_write_is_refused(tmp_path, planted):
    """The old default, /tmp/rollout-service-ray, was made with exist_ok and no check: whoever made it
    first chose the pid files, and with them what a restarted piece kills."""
    folder = tmp_path / "logs"
    if planted == "others may write":
        folder.mkdir()
        folder.chmod(0o777)
    elif planted == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("making a folder of another user needs root")
        folder.mkdir(mode=0o700)
        os.chown(folder, 65534, 65534)
    with pytest.raises(PermissionError) as refused:
        private_folder(folder)
    assert "give logs_dir a folder of your own" in str(refused.value)


@pytest.fixture
def bystander():
    """A process of this user that no piece started: what a forged pid file would name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_pid_file_naming_another_process_kills_nothing(tmp_path, bystander):
    """A pid file is trusted only as far as the process still is what it records: pid, start time
    and command line. Forged ones (the bystander's pid with a piece's command line, or the old
    'pid start-time' form that named any process) leave the bystander running."""
    logs = private_folder(tmp_path / "logs")
    pidfile = logs / "ns.env-0.pid"
    started = actors._start_time(bystander.pid)
    forged = [
        json.dumps({"pid": bystander.pid, "started": started, "cmdline": [sys.executable, "-m", "refenv.cli"]}),
        f"{bystander.pid} {started}",
    ]
    for text in forged:
        pidfile.write_text(text)
        actors._stop_leftover(pidfile)
        assert not pidfile.exists()
        # A SIGKILL lands within microseconds: still running a second later means none was sent.
        with pytest.raises(subprocess.TimeoutExpired):
            bystander.wait(timeout=1)
    # What the actor itself recorded is still stopped: the feature the pid file is for.
    actors._write_pidfile(pidfile, bystander.pid)
    actors._stop_leftover(pidfile)
    assert bystander.wait(30) == -signal.SIGKILL


def test_a_server_whose_guard_was_killed_hard_is_stopped_by_its_successor(tmp_path):
    """An actor records its server's own pid (not its guard's); if the guard is killed hard the
    server runs on, orphaned, holding its port: the next incarnation's _stop_leftover must still
    end it. Oracle: the kernel's process table. Break tried: killpg(pid) on the recorded pid (the
    server is not a group leader: ProcessLookupError, swallowed) -> the server lives on, fails."""
    logs = private_folder(tmp_path / "logs")
    pidfile = logs / "ns.env-0.pid"
    command = [sys.executable, "-c", "import time; time.sleep(600)"]
    server = ManagedProcess("env-0", command, logs / "ns.env-0.log", die_with_parent=True)
    server.start()
    try:
        assert server.pid is not None and server.proc is not None
        actors._write_pidfile(pidfile, server.pid)
        server.proc.send_signal(signal.SIGKILL)  # the guard, not the server
        server.proc.wait(30)
        assert not _gone(server.pid), "the server outlives its guard until someone stops it"
        actors._stop_leftover(pidfile)
        assert wait_until(lambda: _gone(server.pid), 30), "the orphaned server was not stopped"
    finally:
        if server.pid is not None and not _gone(server.pid):
            os.kill(server.pid, signal.SIGKILL)
        server.stop(grace_s=1)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


# -- the pause is a lease: its length is bounded (item 7; its expiry: test_policy_faults.py) ---------


@pytest.mark.parametrize(
    ("body", "error", "words"),
    [
        ({"timeout_s": 3601}, "pause_too_long", "--max-pause-timeout 3600"),
        ({"timeout_s": 0}, None, "timeout_s"),
        ({"timeout_s": "60"}, None, "timeout_s"),
        ({"timeout_s": 60, "forever": True}, None, "forever"),
    ],
)
def test_a_pause_asks_for_a_bounded_lease(scripted_service, body, error, words):
    """Refused before any replica is paused (the scripted replica's log of calls is the oracle)."""
    service, _ = scripted_service
    r = httpx.post(f"{service.url}/policy/pause", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert (error is None or r.json()["error"] == error) and words in r.json()["message"], r.text
    policy = httpx.get(f"{service.url}/policy", timeout=10).json()
    assert policy["paused"] is False and policy["pause_expires_in"] is None, policy


def test_serve_refuses_a_default_pause_over_its_maximum():
    done = cli(
        "serve", "--env", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9", "--model", "m",
        "--pause-timeout", "100", "--max-pause-timeout", "50",
    )  # fmt: skip
    assert done.returncode == 2 and "--max-pause-timeout" in done.stderr and "Traceback" not in done.stderr


# -- DNS rebinding: an unkeyed service on loopback answers loopback names only ---------------------


def _app_client(environ: dict[str, str], **keys: str):
    """The real app, its lifespan not entered (the Host check runs before any route)."""
    from starlette.testclient import TestClient

    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.http.app import create_app

    config = ServiceConfig(env=["http://127.0.0.1:9"], vllm=["http://127.0.0.1:9"], model="m", **keys)
    old = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    try:
        return TestClient(create_app(config), base_url="http://127.0.0.1")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("path", ["/tasks", "/envs", "/health/detail"])
def test_an_unkeyed_service_refuses_a_rebound_host_name(path):
    """A page whose own name was made to resolve to 127.0.0.1 is same-origin with an unkeyed service
    on loopback in the browser's eyes: its requests carry that name as Host, and are refused before any
    route; loopback names are answered. Break tried: LoopbackHostOnly not added in create_app -> the
    evil.example requests reached the routes (503 starting, not 403)."""
    client = _app_client({})
    refused = client.get(path, headers={"Host": "evil.example:8080"})
    assert refused.status_code == 403 and "loopback" in refused.json()["message"], refused.text
    for name in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080"):
        assert client.get(path, headers={"Host": name}).status_code != 403, name


def test_a_keyed_service_does_not_check_host_names():
    """With both planes keyed the key is the guard: a proxy's or a cluster's own name as Host passes to
    the key check (401 without it), not a 403."""
    client = _app_client({"SEC_TEST_KEY": "k" * 32}, api_key_env="SEC_TEST_KEY")
    assert client.get("/tasks", headers={"Host": "trainer-proxy.internal"}).status_code == 401
