"""Run logs and `rollout-service export` (issue #12): a torn last line, run ids that are file
names, and export's filters (`--min-reward`, `--stage`, `--best-of-group`) against expectations
computed here from the log the test wrote, per the README's "The three training workflows".

The group records are real: the service's own run log, written while it ran groups against refenv
(`--responder`, so every attempt has turns of two stages). The model there is the scripted
stand-in (`tests/scripted_model.py`, "answer"): what is tested is the run log's format and
export's selection, not the model, and the stand-in makes every attempt's turns known (one
executor turn, then one responder turn) in a second instead of minutes on the CPU vLLM. Rewards
are then set by the test (the scripted model's attempts of one task all earn the same), so each
filter has something to choose between.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import httpx
import pytest
from helpers import assert_env_accounted, cli

from rollout_service.launch.stack import ManagedProcess, refenv_command, service_command
from rollout_service.runs import read_groups, valid_run_id

SAMPLING = {"temperature": 0.8, "max_tokens": 24}
SCRIPTED_MODEL = Path(__file__).with_name("scripted_model.py")
TASKS = ("t001", "t005", "t002", "t006")

# Per group, the reward of each attempt (None: an env failure, unscored; "pf": a policy failure,
# which earns policy_failure_reward 0.0 but was not graded by the env). With the threshold 0.7:
# group 0's best is in the middle, group 1's first (and one attempt sits exactly at 0.7), group 2's
# last, and group 3 has none that reaches it.
REWARDS: list[list] = [
    [0.3, 0.9, 0.6, 0.1],
    [0.95, None, 0.8, 0.7],
    [0.1, 0.7, 0.2, 0.75],
    [0.5, 0.65, "pf", 0.6],
]


# -- the run log the tests read ------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_groups(tmp_path_factory, logs_dir) -> list[dict]:
    """Four groups of n=4 as the service's run log recorded them (see the module's docstring)."""
    folder = tmp_path_factory.mktemp("served")
    runs = folder / "runs"
    ports = {name: folder / f"{name}.port" for name in ("model", "env", "service")}  # each binds its own
    procs = [
        ManagedProcess(
            "model-runs-export",
            [
                sys.executable,
                str(SCRIPTED_MODEL),
                "--port",
                "0",
                "--script",
                "answer",
                "--port-file",
                str(ports["model"]),
            ],
            logs_dir / "model-runs-export.log",
        ),
        ManagedProcess(
            "refenv-runs-export",
            refenv_command(0, "--pool", "4", "--responder", "--port-file", str(ports["env"])),
            logs_dir / "refenv-runs-export.log",
        ),
    ]
    try:
        urls = []
        for proc, name, ready in zip(procs, ("model", "env"), ("/v1/models", "/health"), strict=True):
            proc.start()
            urls.append(proc.wait_listening(ports[name], ready))
        model_url, env_url = urls
        service = ManagedProcess(
            "service-runs-export",
            service_command(
                0,
                [env_url],
                model_url,
                "--runs-dir",
                str(runs),
                "--run-id",
                "served",
                "--port-file",
                str(ports["service"]),
                model="scripted",
            ),
            logs_dir / "service-runs-export.log",
        )
        procs.append(service)
        service.start()
        service_url = service.wait_listening(ports["service"])
        answers = [
            httpx.post(f"{service_url}/groups", timeout=60, json={"task_id": t, "n": 4, "sampling": SAMPLING}).json()
            for t in TASKS
        ]
        service.stop()  # flushes the run log
        health = httpx.get(f"{env_url}/health", timeout=10).json()
        assert_env_accounted(health)
        assert health["max_waiting"] == 0 and health["leased"] == 0
    finally:
        for proc in reversed(procs):
            proc.stop()
    groups = [json.loads(line) for line in (runs / "served.jsonl").read_text().splitlines()]
    assert [g["group_id"] for g in groups] == [a["group_id"] for a in answers]
    # What the tests rely on: every attempt scored, with an executor turn and a responder turn, all
    # answered by the group's model (no support model), each with its prompt recorded.
    for g in groups:
        assert [a["status"] for a in g["attempts"]] == ["scored"] * 4, g["attempts"]
        for a in g["attempts"]:
            assert [t["stage"] for t in a["turns"]] == ["executor", "responder"], a["turns"]
            assert all(t["model"] == g["model"] and t["messages"] for t in a["turns"])
    return groups


def with_rewards(group: dict, rewards: list) -> dict:
    """A copy of a served group whose attempts earned `rewards` (see REWARDS), the group's
    rewards, counts and advantages made to agree."""
    g = copy.deepcopy(group)
    for attempt, r in zip(g["attempts"], rewards, strict=True):
        if r is None:
            attempt.update(
                status="env_failure",
                reward=None,
                advantage=None,
                failure={"kind": "env_unreachable", "attribution": "infrastructure", "detail": "set by the test"},
            )
        elif r == "pf":
            attempt.update(
                status="policy_failure",
                reward=0.0,
                failure={"kind": "max_turns", "attribution": "policy", "detail": "set by the test"},
            )
        else:
            attempt.update(status="scored", reward=r, failure=None)
    rewarded = [a["reward"] for a in g["attempts"] if a["reward"] is not None]
    mean = sum(rewarded) / len(rewarded)
    for a in g["attempts"]:
        a["advantage"] = None if a["reward"] is None else a["reward"] - mean
    by_status: dict[str, int] = {}
    for a in g["attempts"]:
        by_status[a["status"]] = by_status.get(a["status"], 0) + 1
    scored, policy_failed = by_status.get("scored", 0), by_status.get("policy_failure", 0)
    g.update(
        rewards=[a["reward"] for a in g["attempts"]],
        advantages=[a["advantage"] for a in g["attempts"]],
        mean=mean,
        all_equal=len(set(rewarded)) < 2,
        counts={
            "scheduled": 4,
            "scored": scored,
            "failed": 4 - scored,
            "policy_failed": policy_failed,
            "unscorable": 4 - scored - policy_failed,
            "rewarded": len(rewarded),
            "by_status": by_status,
        },
    )
    return g


@pytest.fixture
def run_log(served_groups, tmp_path) -> tuple[Path, list[dict]]:
    """runs/rs-1.jsonl, written by the test: the served groups with REWARDS."""
    groups = [with_rewards(g, r) for g, r in zip(served_groups, REWARDS, strict=True)]
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "rs-1.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    return runs, groups


def export(runs: Path, out: Path, *flags: str) -> tuple[set[tuple[str, int, int]], list[dict], str]:
    """`rollout-service export rs-1 --runs-dir RUNS --out OUT FLAGS`: the (group, attempt, turn) of
    every record, the records, and what it printed."""
    done = cli("export", "rs-1", "--runs-dir", str(runs), "--out", str(out), *flags)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    keys = {(r["meta"]["group_id"], r["meta"]["attempt"], r["meta"]["turn"]) for r in records}
    assert len(keys) == len(records), "a turn was written twice"
    assert f"kept {len(records)} turn(s)" in done.stdout, done.stdout
    return keys, records, done.stdout


def expected_turns(groups: list[dict], attempts: set[tuple[str, int]], stage: str) -> set[tuple[str, int, int]]:
    return {
        (g["group_id"], a["index"], t["index"])
        for g in groups
        for a in g["attempts"]
        if (g["group_id"], a["index"]) in attempts
        for t in a["turns"]
        if t["stage"] == stage
    }


def reaching(groups: list[dict], threshold: float) -> set[tuple[str, int]]:
    """The README: attempts the env scored with reward >= the threshold."""
    return {
        (g["group_id"], a["index"])
        for g in groups
        for a in g["attempts"]
        if a["status"] == "scored" and a["reward"] >= threshold
    }


def best_of_each_group(groups: list[dict], threshold: float) -> set[tuple[str, int]]:
    """The README: each group's best attempt (the highest reward among those the env scored),
    where it reaches the threshold."""
    best = set()
    for g in groups:
        scored = [a for a in g["attempts"] if a["status"] == "scored"]
        top = max(a["reward"] for a in scored)
        winners = [a for a in scored if a["reward"] == top]
        assert len(winners) == 1, "the test's data must have one best attempt per group"
        if top >= threshold:
            best.add((g["group_id"], winners[0]["index"]))
    return best


# -- export ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.0, 0.7, 0.9])
def test_min_reward_keeps_exactly_the_attempts_at_or_above_it(run_log, tmp_path, threshold):
    runs, groups = run_log
    keys, records, _ = export(runs, tmp_path / "sft.jsonl", "--min-reward", str(threshold))
    kept = reaching(groups, threshold)
    assert kept, "the threshold must keep something for the test to mean anything"
    assert keys == expected_turns(groups, kept, "executor")
    by_id = {g["group_id"]: g for g in groups}
    for record in records:
        turn = by_id[record["meta"]["group_id"]]["attempts"][record["meta"]["attempt"]]["turns"][record["meta"]["turn"]]
        assert record["messages"] == [*turn["messages"], {"role": "assistant", "content": turn["completion"]}]
        assert record["meta"]["reward"] >= threshold


def test_min_reward_boundary_and_what_is_dropped(run_log, tmp_path):
    """0.7 is kept at --min-reward 0.7 (>=, not >); the env failure and the policy failure are
    dropped as unscored even at --min-reward 0 (a policy failure's 0.0 is not a grade)."""
    runs, groups = run_log
    keys, _, printed = export(runs, tmp_path / "a.jsonl", "--min-reward", "0.7")
    attempts = {(g, a) for g, a, _ in keys}
    assert (groups[1]["group_id"], 3) in attempts and (groups[2]["group_id"], 1) in attempts
    keys, _, printed = export(runs, tmp_path / "b.jsonl", "--min-reward", "0")
    attempts = {(g, a) for g, a, _ in keys}
    assert (groups[1]["group_id"], 1) not in attempts and (groups[3]["group_id"], 2) not in attempts
    assert "dropped 1: unscored attempts (env_failure)" in printed
    assert "dropped 1: unscored attempts (policy_failure)" in printed


@pytest.mark.parametrize("stage", ["executor", "responder"])
def test_stage_keeps_only_that_stages_turns(run_log, tmp_path, stage):
    runs, groups = run_log
    keys, records, printed = export(runs, tmp_path / "sft.jsonl", "--stage", stage, "--min-reward", "0.7")
    expected = expected_turns(groups, reaching(groups, 0.7), stage)
    assert expected and keys == expected
    assert {r["meta"]["stage"] for r in records} == {stage}
    other = sum(
        1
        for g in groups
        for a in g["attempts"]
        if (g["group_id"], a["index"]) in reaching(groups, 0.7)
        for t in a["turns"]
        if t["stage"] != stage
    )
    assert f"dropped {other}: turns of other stages" in printed


@pytest.mark.parametrize("threshold", [0.7, 0.0])
def test_best_of_group_keeps_each_groups_highest_reward(run_log, tmp_path, threshold):
    runs, groups = run_log
    keys, _, printed = export(runs, tmp_path / "best.jsonl", "--best-of-group", "--min-reward", str(threshold))
    best = best_of_each_group(groups, threshold)
    # The data puts the best first, in the middle and last, so keeping the first, the last or
    # any other fixed position cannot pass.
    assert {a for _, a in best} >= {0, 1, 3}
    assert keys == expected_turns(groups, best, "executor")
    assert len({g for g, _, _ in keys}) == len(best)
    not_best = len(reaching(groups, threshold)) - len(best)
    assert f"dropped {not_best}: attempts not the best of their group" in printed


# -- reading a run log ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 0.5, -1])
def test_a_torn_last_line_yields_every_complete_group(served_groups, tmp_path, cut):
    """A crash mid-write leaves the last line cut mid-JSON (no newline): every complete group is
    read, and export works from them."""
    lines = [json.dumps(g) for g in served_groups]
    last = lines[-1]
    torn = last[: int(len(last) * cut) if isinstance(cut, float) else cut]
    path = tmp_path / "runs" / "torn.jsonl"
    path.parent.mkdir()
    path.write_text("".join(line + "\n" for line in lines[:-1]) + torn)
    read = [g.group_id for g in read_groups(path)]
    assert read == [g["group_id"] for g in served_groups[:-1]]
    done = cli("export", "torn", "--runs-dir", str(path.parent), "--out", str(tmp_path / "out.jsonl"))
    assert done.returncode == 0, done.stderr
    assert f"in {len(lines) - 1} group(s)" in done.stdout


def test_a_torn_line_before_the_last_is_an_error_naming_it(served_groups, tmp_path):
    lines = [json.dumps(g) for g in served_groups]
    lines[1] = lines[1][: len(lines[1]) // 2]  # line 2 of 4
    path = tmp_path / "runs" / "bad.jsonl"
    path.parent.mkdir()
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError) as err:
        list(read_groups(path))
    assert f"{path}:2:" in str(err.value)
    done = cli("export", "bad", "--runs-dir", str(path.parent), "--out", str(tmp_path / "out.jsonl"))
    assert done.returncode == 2 and f"{path}:2:" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_run_resumed_after_a_torn_write_keeps_every_group(
    served_groups, start_refenv, start_service, start_scripted_model, tmp_path
):
    """The README: reuse a run id to append to its log. When the last run crashed mid-write, the
    groups of the resumed run are not glued onto the torn line: every complete group, old and new,
    is read back. (Scripted model: the run log is tested, not the model.)"""
    runs = tmp_path / "runs"
    runs.mkdir()
    old = [json.dumps(g) for g in served_groups[:2]]
    (runs / "again.jsonl").write_text("".join(line + "\n" for line in old) + old[0][:100])
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], "--runs-dir", str(runs), "--run-id", "again", vllm=model.url, model="scripted")
    new = [
        httpx.post(f"{service.url}/groups", timeout=60, json={"task_id": t, "n": 2, "sampling": SAMPLING}).json()
        for t in ("t001", "t005")
    ]
    service.proc.stop()  # flushes the run log
    read = [g.group_id for g in read_groups(runs / "again.jsonl")]
    assert read == [g["group_id"] for g in served_groups[:2]] + [g["group_id"] for g in new]


# -- export's output is never its input, and is replaced whole ------------------------------------


@pytest.mark.parametrize("alias", ["same path", "symlink", "hardlink"])
def test_export_refuses_an_out_that_is_the_run_log_itself(run_log, tmp_path, alias):
    """Issue #39 item 10: `export X --out X` emptied X and exited 0. Whatever name leads to the run
    log (the path, a symlink, a hard link), export refuses with exit 2 and the log is untouched."""
    runs, _ = run_log
    log = runs / "rs-1.jsonl"
    before = log.read_bytes()
    out = {"same path": log, "symlink": tmp_path / "link.jsonl", "hardlink": tmp_path / "hard.jsonl"}[alias]
    if alias == "symlink":
        out.symlink_to(log)
    elif alias == "hardlink":
        out.hardlink_to(log)
    done = cli("export", str(log), "--out", str(out))
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "is the run log being exported" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert log.read_bytes() == before


def test_a_failed_export_leaves_the_previous_output_as_it_was(served_groups, tmp_path):
    """Written through a temporary file and a rename: an export that fails half-way (a torn line
    before the last) leaves the old --out whole, and no temporary file behind."""
    runs = tmp_path / "runs"
    runs.mkdir()
    lines = [json.dumps(g) for g in served_groups]
    (runs / "bad.jsonl").write_text(lines[0] + "\n" + lines[1][:100] + "\n" + lines[2] + "\n")
    out = tmp_path / "out" / "sft.jsonl"
    out.parent.mkdir()
    out.write_text("the previous export\n")
    done = cli("export", "bad", "--runs-dir", str(runs), "--out", str(out))
    assert done.returncode == 2, done.stderr
    assert out.read_text() == "the previous export\n"
    assert [p.name for p in out.parent.iterdir()] == ["sft.jsonl"]


def test_export_replaces_a_symlinked_out_instead_of_writing_through_it(run_log, tmp_path):
    """--out that is a symlink to another file: the link is replaced by the export, its target untouched."""
    runs, _ = run_log
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours\n")
    out = tmp_path / "sft.jsonl"
    out.symlink_to(victim)
    _, records, _ = export(runs, out)
    assert records and not out.is_symlink() and victim.read_text() == "not yours\n"


# -- run ids --------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["../x", "a/b", ".hidden", "x..y", "x\n"])
def test_serve_refuses_a_run_id_that_is_not_a_plain_file_name(tmp_path, run_id):
    """Refused before anything starts: exit 2, one line naming --run-id, and no file anywhere.
    (The env and model URLs lead nowhere: past the check, serve would fail to start with exit 1.)"""
    runs = tmp_path / "a" / "runs"
    done = cli(
        "serve", "--env", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9", "--model", "m",
        "--runs-dir", str(runs), "--run-id", run_id,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    assert "\n" not in message and "--run-id" in message and "Traceback" not in message, message
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not valid_run_id(run_id)


def test_serve_takes_a_valid_run_id_past_the_check(tmp_path):
    done = cli(
        "serve", "--env", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9", "--model", "m",
        "--runs-dir", str(tmp_path / "runs"), "--run-id", "distil-1",
        "--startup-timeout", "1", "--listen", "127.0.0.1:0",
    )  # fmt: skip
    assert done.returncode == 1 and "cannot start" in done.stderr and "--run-id" not in done.stderr, done.stderr


@pytest.mark.parametrize("run_id", ["r1", "distil-1", "rs_2.v3", "run-20261129-165636-6a6528", "A", "x.y", "0" * 100])
def test_valid_run_id_accepts_plain_file_names(run_id):
    assert valid_run_id(run_id)


@pytest.mark.parametrize("run_id", ["", "a b", "a\\b", "x\n", "x\x00", "../x", "a/b", ".hidden", "x..y", ".."])
def test_valid_run_id_refuses_what_is_not_a_plain_file_name(run_id):
    """The README: run ids are checked (they become file names: letters, digits, '.', '_', '-')."""
    assert not valid_run_id(run_id)
