"""The three training workflows: teacher distillation, rejection sampling, held-out measurement."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from helpers import assert_accounted, cli, wait_until

from rollout_service.launch import embedded_model
from rollout_service.launch.stack import port_in_use

SAMPLING = {"temperature": 0.8, "max_tokens": 32}


def test_teacher_and_policy_side_by_side(start_refenv, start_service, vllm_url):
    env = start_refenv("--pool", "4")
    # The "teacher" is any OpenAI-compatible server; here the same CPU vLLM under another name,
    # asked as a non-vLLM server would be (no token ids).
    service = start_service(
        [env.url], "--model-endpoint", f"teacher={vllm_url},model={embedded_model.MODEL_NAME},token-ids=false"
    )
    teacher = httpx.post(
        f"{service.url}/groups", timeout=300, json={"task_id": "t001", "n": 2, "model": "teacher", "sampling": SAMPLING}
    ).json()
    policy = httpx.post(
        f"{service.url}/groups", timeout=300, json={"task_id": "t001", "n": 2, "sampling": SAMPLING}
    ).json()
    assert teacher["model"] == "teacher" and policy["model"] == embedded_model.MODEL_NAME
    teacher_turns = [t for a in teacher["attempts"] for t in a["turns"]]
    policy_turns = [t for a in policy["attempts"] for t in a["turns"]]
    assert teacher_turns and all(
        t["token_source"] == "absent"
        and t["completion_token_ids"] is None
        and t["logprobs"] is None
        and t["model"] == "teacher"
        for t in teacher_turns
    )
    assert policy_turns and all(t["token_source"] == "server" and t["completion_token_ids"] for t in policy_turns)
    models = httpx.get(f"{service.url}/health/detail").json()["models"]
    assert {m["role"] for m in models} == {"policy", "named:teacher"} and all(m["ok"] for m in models)


def test_run_log_survives_restart_and_exports_round_trip(start_refenv, start_service, tmp_path):
    env = start_refenv("--pool", "4")
    runs = tmp_path / "runs"
    first = start_service([env.url], "--runs-dir", str(runs), "--run-id", "r1")
    for task in ("t001", "t005"):
        g = httpx.post(f"{first.url}/groups", timeout=300, json={"task_id": task, "n": 2, "sampling": SAMPLING}).json()
        assert g["run_id"] == "r1"
    assert httpx.get(f"{first.url}/health/detail").json()["run_id"] == "r1"
    first.proc.stop()
    second = start_service([env.url], "--runs-dir", str(runs), "--run-id", "r1")
    httpx.post(f"{second.url}/groups", timeout=300, json={"task_id": "t002", "n": 2, "sampling": SAMPLING})
    second.proc.stop()
    lines = (runs / "r1.jsonl").read_text().splitlines()
    assert [json.loads(x)["task_id"] for x in lines] == ["t001", "t005", "t002"]

    out = tmp_path / "sft.jsonl"
    done = cli("export", "r1", "--runs-dir", str(runs), "--min-reward", "0", "--out", str(out))
    assert done.returncode == 0, done.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    groups = {json.loads(x)["group_id"]: json.loads(x) for x in lines}
    expected_turns = sum(
        1
        for g in groups.values()
        for a in g["attempts"]
        if a["status"] == "scored"
        for t in a["turns"]
        if t["stage"] == "executor"
    )
    assert len(records) == expected_turns > 0 and f"kept {len(records)} turn(s)" in done.stdout
    for record in records:
        meta = record["meta"]
        turn = groups[meta["group_id"]]["attempts"][meta["attempt"]]["turns"][meta["turn"]]
        assert record["messages"][:-1] == turn["messages"]  # the prompt, exactly as the env sent it
        assert record["messages"][-1] == {"role": "assistant", "content": turn["completion"]}
        assert meta["policy_version"] == turn["policy_version"] == "base"  # no update was made

    best = cli("export", str(runs / "r1.jsonl"), "--best-of-group", "--out", str(tmp_path / "best.jsonl"))
    assert best.returncode == 0 and "not the best of their group" in best.stdout
    best_attempts = {
        (json.loads(x)["meta"]["group_id"], json.loads(x)["meta"]["attempt"])
        for x in (tmp_path / "best.jsonl").read_text().splitlines()
    }
    assert len({g for g, _ in best_attempts}) == len(best_attempts) <= 3
    missing = cli("export", "nope", "--runs-dir", str(runs), "--out", str(tmp_path / "x.jsonl"))
    assert missing.returncode == 2 and "r1" in missing.stderr and "Traceback" not in missing.stderr


def test_export_refuses_eval_side_and_unscored_with_counts(start_refenv, start_service, tmp_path):
    evals = start_refenv("--pool", "2", "--split", "auto:0.8", "--side", "eval")
    failing = start_refenv("--pool", "2", "--fail-rate", "1.0", "--seed", "4")
    eval_task = httpx.get(f"{evals.url}/tasks").json()["tasks"][0]["task_id"]
    runs = tmp_path / "runs"
    on_eval = start_service([evals.url], "--runs-dir", str(runs), "--run-id", "eval-run")
    refused = httpx.post(f"{on_eval.url}/groups", json={"task_id": eval_task, "n": 2, "sampling": SAMPLING})
    assert refused.status_code == 409 and "allow_eval_side" in refused.json()["message"]
    ok = httpx.post(
        f"{on_eval.url}/groups",
        timeout=300,
        json={"task_id": eval_task, "n": 2, "allow_eval_side": True, "sampling": SAMPLING},
    )
    assert ok.status_code == 200 and ok.json()["env"]["side"] == "eval"
    on_eval.proc.stop()
    done = cli("export", "eval-run", "--runs-dir", str(runs), "--out", str(tmp_path / "e.jsonl"))
    assert done.returncode == 0 and "kept 0 turn(s)" in done.stdout
    assert "dropped 2: attempts from an eval-side env" in done.stdout
    loud = cli("export", "eval-run", "--runs-dir", str(runs), "--allow-eval-side", "--out", str(tmp_path / "e2.jsonl"))
    assert "WARNING" in loud.stderr and "kept 0 turn(s)" not in loud.stdout

    broken = start_service([failing.url], "--runs-dir", str(runs), "--run-id", "failing-run")
    g = httpx.post(
        f"{broken.url}/groups", timeout=300, json={"task_id": "t005", "n": 3, "retries": 0, "sampling": SAMPLING}
    ).json()
    assert g["counts"]["scored"] == 0 and g["counts"]["failed"] == 3
    broken.proc.stop()
    done = cli("export", "failing-run", "--runs-dir", str(runs), "--out", str(tmp_path / "f.jsonl"))
    assert "dropped 3: unscored attempts (env_failure)" in done.stdout and "kept 0 turn(s)" in done.stdout


def test_measure_prints_an_interval_containing_the_observed_rate(start_refenv, vllm_url):
    evals = start_refenv("--pool", "4", "--split", "auto:0.8", "--side", "eval")
    done = cli(
        "measure",
        "--env",
        evals.url,
        "--vllm",
        vllm_url,
        "--model",
        embedded_model.MODEL_NAME,
        "--repeats",
        "2",
        "--limit",
        "3",
        "--max-tokens",
        "32",
        "--max-turns",
        "2",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    assert m["tasks"] == 3 and m["scheduled"] == 6
    lo, hi = m["wilson95"]
    assert lo <= m["pass_rate"] <= hi and 0 < m["resolution_floor"] <= 1
    assert m["env"]["side"] == "eval" and m["env"]["catalog_hash"]
    text = cli(
        "measure",
        "--env",
        evals.url,
        "--vllm",
        vllm_url,
        "--model",
        embedded_model.MODEL_NAME,
        "--repeats",
        "1",
        "--limit",
        "2",
        "--max-tokens",
        "16",
        "--max-turns",
        "2",
    )
    assert text.returncode == 0 and "Wilson interval" in text.stdout and "resolution floor" in text.stdout


def test_measure_max_turns_stops_each_episode_and_says_so(start_refenv, start_scripted_model):
    """--max-turns must reach every episode: a model that only ever queries (a scripted stand-in, the
    real one may answer at once) is stopped after that many calls, which the env's own step counter sees,
    and the JSON says which limit the rate was measured under."""
    model = start_scripted_model("sql-forever")
    evals = start_refenv("--pool", "4", "--split", "auto:0.8", "--side", "eval")
    before = httpx.get(f"{evals.url}/health", timeout=10).json()
    max_turns = 2
    done = cli(
        "measure", "--env", evals.url, "--vllm", model.url, "--model", "scripted",
        "--repeats", "2", "--limit", "2", "--max-turns", str(max_turns), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    assert m["max_turns"] == max_turns and m["sampling"]["max_tokens"] == 128
    episodes = m["scheduled"]
    assert episodes == 4 and m["policy_failures"] == episodes and m["pass_rate"] == 0.0
    after = httpx.get(f"{evals.url}/health", timeout=10).json()
    started = after["episodes"]["started"] - before["episodes"]["started"]
    steps = after["steps"] - before["steps"]
    # Each episode got at most max_turns completions (the last may be abandoned before it is stepped).
    assert started == episodes and (max_turns - 1) * episodes <= steps <= max_turns * episodes, (started, steps)


def test_demo_runs_groups_and_stops_what_it_started(vllm_url, tmp_path):
    """The README's first command, on the session's vLLM (the demo starts its own refenv and service)."""
    out = tmp_path / "demo.json"
    done = cli(
        "demo",
        "--vllm",
        vllm_url,
        "--groups",
        "2",
        "--n",
        "4",
        "--pool",
        "4",
        "--max-tokens",
        "48",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    groups = json.loads(out.read_text())["groups"]
    assert [g["n"] for g in groups] == [4, 4]
    for group in groups:
        assert_accounted(group)
    assert "0 held now" in done.stdout
    started = re.findall(r"\[(?:refenv|service)\] ready at (http://\S+)", done.stdout)
    assert len(started) == 2, done.stdout
    for url in started:
        port = int(url.rsplit(":", 1)[1])
        assert not port_in_use(port), f"{url} still answers after the demo ended"


def _ready_urls(output: str) -> dict[str, str]:
    """What the demo said it started: {"refenv": URL, "service": URL} from its `[x] ready at URL` lines."""
    return dict(re.findall(r"\[(refenv|service)\] ready at (http://\S+)", output))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _processes() -> dict[int, dict]:
    """Every process on this machine: pid -> {ppid, pgid, state, start, cmdline} (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it ended while we looked
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        found[int(entry.name)] = {
            "state": fields[0],
            "ppid": int(fields[1]),
            "pgid": int(fields[2]),
            "start": fields[19],
            "cmdline": cmdline,
        }
    return found


def _left_behind(children: dict[int, dict], ports: list[int]) -> dict[int, str]:
    """Processes still alive (not zombies) that are one of `children` (same pid and start time),
    in one of their process groups, or listening on or pointed at one of `ports`: pid -> cmdline."""
    left = {}
    for pid, p in _processes().items():
        if p["state"] in "ZX":
            continue
        same = pid in children and children[pid]["start"] == p["start"]
        if same or p["pgid"] in children or any(f"127.0.0.1:{port}" in p["cmdline"] for port in ports):
            left[pid] = p["cmdline"]
    return left


def _kill(pids) -> None:
    """SIGKILL what a failed demo test left behind (processes it started), each by its id."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_demo_that_cannot_start_stops_what_it_started_and_says_why(tmp_path):
    """The README: the demo stops every process it started on error too. With nothing at the model
    URL the service refuses to start: the demo exits non-zero without a traceback, and the refenv it
    had started (it says where) no longer answers, nor does any process of it remain. (No vLLM is
    needed: the service never gets past its start-up check.)"""
    done = cli(
        "demo", "--vllm", "http://127.0.0.1:9", "--groups", "1", "--n", "2", "--pool", "2",
        "--json", str(tmp_path / "demo.json"), cwd=tmp_path, timeout=180,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode not in (0, 130), output
    assert "Traceback" not in output and "unreachable" in done.stderr, output
    started = _ready_urls(done.stdout)
    assert set(started) == {"refenv"}, output  # the service never became ready
    port = _port(started["refenv"])
    left = _left_behind({}, [port])
    try:
        assert not port_in_use(port), f"{started['refenv']} still answers after the demo failed"
        assert not left, left
    finally:  # only the refenv the demo started can be listening on its port
        _kill(pid for pid, cmdline in left.items() if f"--listen 127.0.0.1:{port}" in cmdline)


_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def test_demo_interrupted_stops_everything_it_started(vllm_url, tmp_path):
    """The README: Ctrl-C stops every process the demo started. SIGINT goes to the demo's process
    group (what a terminal's Ctrl-C does) while its groups run on the env: it exits 130, neither the
    refenv nor the service it printed still answers, and none of its child processes is left."""
    # -X faulthandler: should the demo ever hang on the way out, SIGABRT prints where (below).
    cmd = [sys.executable, "-X", "faulthandler", "-m", "rollout_service.tools.cli", "demo", "--vllm", vllm_url,
           "--groups", "8", "--n", "4", "--pool", "4", "--max-tokens", "48",
           "--json", str(tmp_path / "demo.json")]  # fmt: skip
    # As from a terminal: Ctrl-C's default action. A suite started in the background by a shell
    # without job control (`cmd &` in a script) inherits SIGINT ignored, and Python then keeps
    # ignoring it: the demo would rightly run on. Reset it, then exec the demo.
    cmd = [sys.executable, "-c", _WITH_DEFAULT_SIGINT, *cmd]
    demo = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    children: dict[int, dict] = {}
    try:
        assert wait_until(lambda: "[service] ready at" in "".join(lines), timeout_s=180), "".join(lines)
        started = _ready_urls("".join(lines))
        # Interrupt it mid-batch: once the service holds worlds on the env.
        assert wait_until(lambda: httpx.get(f"{started['refenv']}/health").json()["leased"] > 0, 60), "".join(lines)
        children = {pid: p for pid, p in _processes().items() if p["ppid"] == demo.pid}
        kinds = sorted(("refenv.cli" in p["cmdline"], "tools.cli serve" in p["cmdline"]) for p in children.values())
        assert kinds == [(False, True), (True, False)], children  # its refenv and its service
        os.killpg(demo.pid, signal.SIGINT)
        try:
            code = demo.wait(90)
        except subprocess.TimeoutExpired:
            demo.send_signal(signal.SIGABRT)  # faulthandler dumps every thread's stack to its output
            demo.wait(10)
            reader.join(10)
            raise AssertionError("the demo did not exit within 90 s of Ctrl-C:\n" + "".join(lines)) from None
        assert code == 130, "".join(lines)
        reader.join(10)
        output = "".join(lines)
        assert "Traceback" not in output, output
        for url in started.values():
            assert not port_in_use(_port(url)), f"{url} still answers after the demo was interrupted"
        assert not _left_behind(children, [_port(u) for u in started.values()])
    finally:  # whatever the outcome, nothing this test started outlives it
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
        _kill(_left_behind(children, []))
