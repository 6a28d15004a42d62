"""`rollout-service view RUNLOG` (the real command, over HTTP) when the run log is hostile or changes
under it, and when a page elsewhere tries to read it. No browser: tests/test_viewer.py drives the pages.

The run logs are written by the test: what matters here is the file (torn, rewritten, truncated,
deleted), not what the groups say, so each line is a small group record made to the protocol rather
than one from a real run (tests/test_viewer.py views a real run's log).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from rollout_service.viewer.routes import CSP


def _group(group_id: str, rewards: list[float]) -> dict:
    attempts = [
        {"index": i, "status": "scored", "reward": r, "advantage": r - sum(rewards) / len(rewards)}
        for i, r in enumerate(rewards)
    ]
    return {
        "group_id": group_id,
        "task_id": "t001",
        "slug": "one",
        "model": "m",
        "sampling": {},
        "n": len(rewards),
        "advantage_kind": "mean",
        "env": {"urls": ["http://env"], "catalog_hash": "c", "reward_version": "1", "reward_profile": "rl"},
        "counts": {
            "scheduled": len(rewards),
            "scored": len(rewards),
            "failed": 0,
            "policy_failed": 0,
            "unscorable": 0,
            "rewarded": len(rewards),
            "by_status": {"scored": len(rewards)},
        },
        "rewards": rewards,
        "advantages": [a["advantage"] for a in attempts],
        "mean": sum(rewards) / len(rewards),
        "std": 0.0,
        "pass_rate": None,
        "all_equal": len(set(rewards)) == 1,
        "attempts": attempts,
        "wall_s": 1.0,
        "completion_tokens": 10,
    }


def _lines(*ids: str) -> str:
    return "".join(json.dumps(_group(g, [0.0, 1.0])) + "\n" for g in ids)


@pytest.fixture
def view(launch, tmp_path):
    """view(log) -> the URL of `rollout-service view LOG` on 127.0.0.1, no key."""

    def start(log: Path) -> str:
        cmd = [sys.executable, "-m", "rollout_service.tools.cli", "view", str(log), "--listen", "127.0.0.1:0"]
        return launch("viewer", None, cmd, ready_path="/ui").url

    return start


def _listed(url: str) -> list[str]:
    answer = httpx.get(f"{url}/ui/api/groups", timeout=30)
    assert answer.status_code == 200, answer.text
    return [g["group_id"] for g in answer.json()["groups"]]


def test_a_run_log_that_changes_under_the_viewer_is_never_a_500(view, tmp_path):
    """Appended to (a torn line waits for its end), rewritten in place, truncated and rewritten,
    replaced by another file, then by a FIFO, deleted: the list answers what the file holds (or what was indexed while
    it could be read), and a group whose line is gone is a clear 409, never a stack trace.
    Breaks tried (before the fix): the index kept after truncation -> fails: the list still shows the
    old groups; a group's line read again unchecked -> fails: 500 on a line rewritten in place; the
    file deleted -> fails: every read was a 500 (the refresh raised); the log opened without O_NONBLOCK
    -> fails: replaced by a FIFO, the list request timed out (the open waited for a writer)."""
    log = tmp_path / "run.jsonl"
    log.write_text(_lines("a0", "a1", "a2"))
    url = view(log)
    assert _listed(url) == ["a2", "a1", "a0"]

    with log.open("a") as f:  # the service writing a line: seen once it is whole
        f.write(_lines("a3")[:40])
    assert _listed(url) == ["a2", "a1", "a0"]
    with log.open("a") as f:
        f.write(_lines("a3")[40:])
    assert _listed(url) == ["a3", "a2", "a1", "a0"]

    # Rewritten in place, same size: the index cannot tell, the group's page can.
    text = log.read_text()
    log.write_text(text.replace('"a0"', '"b0"'))
    changed = httpx.get(f"{url}/ui/api/groups/0", timeout=30)
    assert changed.status_code == 409 and "changed under the viewer" in changed.json()["message"], changed.text
    assert changed.headers["content-security-policy"] == CSP
    log.write_text(text[:10])  # garbage of the same first bytes, then a real line again
    assert httpx.get(f"{url}/ui/api/groups/0", timeout=30).status_code in (404, 409)

    # Truncated and written anew: indexed again from the start.
    log.write_text(_lines("c0", "c1"))
    assert _listed(url) == ["c1", "c0"]
    assert httpx.get(f"{url}/ui/api/groups/1", timeout=30).json()["group_id"] == "c1"

    # Replaced by another file (a rename over it, as an editor or a copy does): indexed again.
    other = tmp_path / "other.jsonl"
    other.write_text(_lines("d0", "d1", "d2", "d3", "d4"))
    other.replace(log)
    assert _listed(url) == ["d4", "d3", "d2", "d1", "d0"]

    # Replaced by a FIFO: opening it to read would wait for a writer; the viewer does not wait.
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    fifo.replace(log)
    assert httpx.get(f"{url}/ui/api/groups", timeout=10).json()["total"] == 5
    assert httpx.get(f"{url}/ui/api/groups/2", timeout=10).status_code == 409

    # Deleted: what was indexed stays listed; a group's page says the log changed.
    log.unlink()
    assert _listed(url) == ["d4", "d3", "d2", "d1", "d0"]
    gone = httpx.get(f"{url}/ui/api/groups/2", timeout=30)
    assert gone.status_code == 409 and "changed under the viewer" in gone.json()["message"], gone.text
    assert httpx.get(f"{url}/ui/api/overview", timeout=30).json()["groups"] == 5


def test_without_a_key_the_viewer_answers_loopback_names_only(view, tmp_path):
    """DNS rebinding: a page at http://evil.example:PORT whose name was made to resolve to 127.0.0.1 is
    same-origin with the viewer in the browser's eyes; its requests carry `Host: evil.example:PORT`.
    The keyless viewer refuses them (with the CSP); loopback names are served.
    Break tried: LoopbackHostOnly not added -> fails: the run log was answered to Host evil.example."""
    log = tmp_path / "run.jsonl"
    log.write_text(_lines("a0"))
    url = view(log)
    port = url.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"10.0.0.1:{port}"):
        for path in ("/ui/api/groups", "/ui"):
            refused = httpx.get(f"{url}{path}", headers={"Host": host}, timeout=30)
            assert refused.status_code == 403 and "loopback" in refused.json()["message"], (host, refused.text)
            assert refused.headers["content-security-policy"] == CSP
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.2"):
        assert httpx.get(f"{url}/ui/api/groups", headers={"Host": host}, timeout=30).status_code == 200, host


def test_bad_filters_are_clear_errors(view, tmp_path):
    """A reward bound that is not a number is a 422, not a filter that quietly matches everything.
    Break tried: the bounds without allow_inf_nan=False -> fails: min_reward=nan answered 200 with
    every group (no comparison with nan is true, so nothing was filtered out)."""
    log = tmp_path / "run.jsonl"
    log.write_text(_lines("a0", "a1"))
    url = view(log)
    for bad in ("min_reward=nan", "max_reward=NaN", "min_reward=inf", "offset=-1", "limit=0", "limit=101"):
        answer = httpx.get(f"{url}/ui/api/groups?{bad}", timeout=30)
        assert answer.status_code == 422, (bad, answer.text)
        assert answer.headers["content-security-policy"] == CSP
    assert httpx.get(f"{url}/ui/api/groups?min_reward=0.5", timeout=30).json()["total"] == 2
    assert httpx.get(f"{url}/ui/api/groups?min_reward=0.6", timeout=30).json()["total"] == 0
