"""Safe by default (issue #39, items 5-12): each hole an attacker found is refused, and each test here
was seen failing on the code that had the hole."""

from __future__ import annotations

import asyncio
import os
import stat

import httpx
import pytest
from helpers import cli

from rollout_service.server.runlog import RunLog

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
