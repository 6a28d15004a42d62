"""Group tail control (`deadline_s`, `min_graded`): a group closes once k attempts are graded or its
deadline passes, and the attempts still running are cut, their worlds given back.

Real refenv over HTTP: its own counters are the oracle (episodes started, finished and abandoned;
worlds leased). The model is the scripted stand-in with `--odd-seed-delay`: a real vLLM cannot be
made to keep some attempts of a group far slower than others. A group with an even seed and one
turn per attempt (`answer`) has its odd attempts wait 60 s for their completion: a tail certain to be
running when the group closes.
"""

from __future__ import annotations

import httpx
from helpers import assert_env_accounted, wait_until

SLOW = ("--odd-seed-delay", "60")


def _group(**tail) -> dict:
    return {
        "task_id": "t001",
        "n": 4,
        "retries": 0,
        "sampling": {"temperature": 0.8, "max_tokens": 24, "seed": 2},
        **tail,
    }


def _env_settles(env) -> dict:
    """refenv's /health once every world is back in its pool: nothing leased, nothing live."""
    health: dict = {}

    def settled() -> bool:
        health.update(httpx.get(f"{env.url}/health", timeout=10).json())
        return health["leased"] == 0 and health["live_episodes"] == 0

    assert wait_until(settled, timeout_s=20), f"worlds not given back: {health}"
    assert_env_accounted(health)
    return health


def _check_cut(result: dict, closed_by: str) -> None:
    by_index = {a["index"]: a for a in result["attempts"]}
    for i in (0, 2):  # even seeds: answered at once, graded
        assert by_index[i]["status"] == "scored", by_index[i]
        assert result["rewards"][i] is not None
    for i in (1, 3):  # odd seeds: still waiting for the model when the group closed
        cut = by_index[i]
        assert cut["status"] == "cut", cut
        assert (cut["failure"]["kind"], cut["failure"]["attribution"]) == ("group_closed", "request"), cut
        assert cut["reward"] is None and cut["advantage"] is None and cut["pass"] is None
        assert result["rewards"][i] is None and result["advantages"][i] is None
    assert result["baseline"] == {"over": 2, "cut": 2, "closed_by": closed_by, "cut_attempts": [1, 3]}
    counts = result["counts"]
    assert (counts["scheduled"], counts["scored"], counts["rewarded"], counts["cut"]) == (4, 2, 2, 2), counts
    assert counts["by_status"] == {"scored": 2, "cut": 2}
    assert counts["scheduled"] == counts["scored"] + counts["failed"]


def _closed_group(start_refenv, start_service, start_scripted_model, closed_by: str, **tail) -> tuple:
    """(model, env, service) after one group with `tail` control, closed by `closed_by`, was checked."""
    model = start_scripted_model("answer", *SLOW)
    env = start_refenv("--pool", "4")
    service = start_service([env.url], vllm=model.url, model="scripted")
    answer = httpx.post(f"{service.url}/groups", json=_group(**tail), timeout=30)
    assert answer.status_code == 200, answer.text
    _check_cut(answer.json(), closed_by)
    assert 0 < answer.json()["wall_s"] < 20, answer.json()["wall_s"]
    return model, env, service, answer.json()


def test_min_graded_closes_the_group_cuts_the_tail_and_gives_its_worlds_back(
    start_refenv, start_service, start_scripted_model
):
    """Breaks tried: run_until_closed never checking min_graded -> the group waits out the 60 s tail
    (fails at the 30 s read timeout); AttemptRun.cut not relabelling the try -> status `cancelled`
    (fails at `status == cut`); a cut try skipping the endings (no parts.endings.end when cut_reason is
    set) -> 2 episodes stay live and 2 worlds leased on the env (fails in _env_settles)."""
    model, env, _, _ = _closed_group(start_refenv, start_service, start_scripted_model, "min_graded", min_graded=2)
    seeds = httpx.get(f"{model.url}/stats", timeout=10).json()["by_seed"]
    assert {"7921", "23759"} <= seeds.keys(), seeds  # the cut attempts were asking the model when cut
    health = _env_settles(env)
    assert (health["episodes"]["started"], health["episodes"]["finished"], health["episodes"]["abandoned"]) == (
        4,
        2,
        2,
    ), health["episodes"]


def test_a_deadline_closes_the_group_and_a_group_without_tail_control_has_no_baseline(
    start_refenv, start_service, start_scripted_model
):
    """Breaks tried: run_until_closed waiting without the deadline as its timeout -> the 60 s tail is
    waited out (fails at the read timeout); assemble without closed_by -> no `baseline` (fails at the
    baseline check)."""
    _, env, service, result = _closed_group(start_refenv, start_service, start_scripted_model, "deadline", deadline_s=3)
    assert result["wall_s"] >= 3, result["wall_s"]
    _env_settles(env)
    plain = httpx.post(f"{service.url}/groups", json={**_group(), "n": 1}, timeout=30)
    assert plain.status_code == 200, plain.text
    assert plain.json()["baseline"] is None and plain.json()["counts"]["cut"] == 0
    refused = httpx.post(f"{service.url}/groups", json=_group(min_graded=5), timeout=30)
    assert refused.status_code == 422 and "min_graded=5" in refused.text, refused.text
    _env_settles(env)
