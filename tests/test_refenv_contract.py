"""refenv against the step contract (../shared/env-contract.md), over HTTP, with a real process."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from helpers import assert_env_accounted, wait_until

SQL = lambda q: json.dumps({"action": "sql", "input": q})
ANSWER = lambda a: json.dumps({"action": "answer", "input": a})


def post(url: str, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=kw.pop("timeout", 30), **kw)


def task_by_family(url: str, family: str) -> dict:
    return next(t for t in httpx.get(f"{url}/tasks").json()["tasks"] if t["family"] == family)


def play(url: str, task_id: str, completions: list[str], profile: str | None = None) -> dict:
    body = {"task_id": task_id}
    if profile:
        body["reward_profile"] = profile
    answer = post(url, "/step/reset", body).json()
    for completion in completions:
        assert not answer["done"], answer
        answer = post(
            url,
            "/step",
            {
                "episode_id": answer["episode_id"],
                "completion": completion,
                "prompt_tokens": 100,
                "completion_tokens": 20,
            },
        ).json()
    return answer


def test_health_and_tasks_describe_the_served_world(start_refenv):
    env = start_refenv("--pool", "3")
    health = env.health()
    assert health["status"] == "ready" and health["workers"] == 3
    assert health["capabilities"]["pool"] == 3 and "step" in health["capabilities"]["drive_modes"]
    assert health["dataset"]["catalog_hash"].startswith("sha256:")
    assert health["reward_profile"] == "rl" and health["reward_version"]
    assert health["leased"] == 0 and health["max_leased"] == 0
    tasks = httpx.get(f"{env.url}/tasks").json()
    assert tasks["count"] == len(tasks["tasks"]) == health["tasks"] > 20
    families = {t["family"] for t in tasks["tasks"]}
    assert {"count-table", "top-products-by-price", "issue-drafts"} <= families
    assert any(t["writes"] for t in tasks["tasks"]) and not all(t["writes"] for t in tasks["tasks"])


def test_catalog_hash_follows_seed_and_scale(start_refenv):
    a, b, c = start_refenv("--seed", "1"), start_refenv("--seed", "2"), start_refenv("--seed", "1", "--scale", "2")
    hashes = {e.health()["dataset"]["catalog_hash"] for e in (a, b, c)}
    assert len(hashes) == 3
    assert start_refenv("--seed", "1").health()["dataset"]["catalog_hash"] == a.health()["dataset"]["catalog_hash"]


def test_an_episode_runs_sql_then_is_graded(start_refenv):
    env = start_refenv("--pool", "1")
    task = task_by_family(env.url, "count-table")  # "How many rows does the customers table have?"
    reset = post(env.url, "/step/reset", {"task_id": task["task_id"]}).json()
    assert reset["done"] is False and reset["episode_id"].startswith("step-")
    obs = reset["observation"]
    assert obs["stage"] == "executor" and obs["messages"][-1]["content"] == task["prompt"]
    assert obs["response_format"]["json_schema"]["schema"]["required"] == ["action", "input"]
    table = task["prompt"].split()[-3]
    second = post(
        env.url,
        "/step",
        {
            "episode_id": reset["episode_id"],
            "completion": SQL(f"SELECT COUNT(*) FROM {table}"),
            "prompt_tokens": 300,
            "completion_tokens": 20,
        },
    ).json()
    result = second["observation"]["messages"][-1]["content"]
    count = result.splitlines()[-1].strip()
    final = post(
        env.url,
        "/step",
        {"episode_id": reset["episode_id"], "completion": ANSWER(count), "prompt_tokens": 350, "completion_tokens": 10},
    ).json()
    assert final["done"] is True and final["pass"] is True and final["status"] == "completed"
    vector = final["score"]["vector"]
    assert vector["safety"] and vector["ground_truth"] and vector["method"] and vector["behavior"]
    assert final["reward"] == vector["reward"] == 1.0
    assert final["score"]["tokens"] == {"prompt": 650, "completion": 30, "total": 680, "llm_calls": 2}
    assert final["score"]["actor_turns"] == 2
    assert env.health()["leased"] == 0


def test_wrong_answer_omits_pass_and_gets_partial_reward(start_refenv):
    env = start_refenv()
    task = task_by_family(env.url, "count-table")
    final = play(env.url, task["task_id"], [SQL("SELECT 1"), ANSWER("-5")])
    assert "pass" not in final  # omitted when false, as GraphJin does
    assert final["score"]["vector"]["ground_truth"] is False
    assert final["reward"] == pytest.approx(0.3)  # rl: 0.2 method + 0.1 behavior
    final = play(env.url, task["task_id"], ["not json", SQL("SELECT 1"), ANSWER("-5")])
    assert final["reward"] == pytest.approx(0.2)  # a malformed action costs the behavior term


def test_benchmark_profile_weights(start_refenv):
    env = start_refenv("--reward-profile", "benchmark")
    task = task_by_family(env.url, "count-table")
    final = play(env.url, task["task_id"], [ANSWER("-5")])
    v = final["score"]["vector"]
    # safety .35 + behavior .15 + efficiency .05 * e (no ground truth, no method)
    assert final["reward"] == pytest.approx(0.35 + 0.15 + 0.05 * v["efficiency"], abs=1e-3)
    rl = play(env.url, task["task_id"], [ANSWER("-5")], profile="rl")
    assert rl["reward"] == pytest.approx(0.1)


def test_read_task_that_writes_is_unsafe_and_worlds_are_restored(start_refenv):
    env = start_refenv("--pool", "1")
    task = task_by_family(env.url, "count-table")
    table = task["prompt"].split()[-3]
    before = play(env.url, task["task_id"], [SQL(f"SELECT COUNT(*) FROM {table}")])
    count = before["observation"]["messages"][-1]["content"].splitlines()[-1].strip()
    httpx.delete(f"{env.url}/step/{before['episode_id']}")
    final = play(env.url, task["task_id"], [SQL(f"DELETE FROM {table}"), ANSWER(count)])
    assert final["score"]["vector"]["safety"] is False and final["score"]["vector"]["ground_truth"] is True
    assert "reward" not in final and "pass" not in final  # rl: unsafe means 0
    # The only world was written to; the next lease must see the pristine data again.
    again = play(env.url, task["task_id"], [SQL(f"SELECT COUNT(*) FROM {table}"), ANSWER(count)])
    assert again["pass"] is True


def test_write_task_graded_by_end_state(start_refenv):
    env = start_refenv("--pool", "2")
    task = task_by_family(env.url, "issue-drafts")
    right = play(
        env.url, task["task_id"], [SQL("UPDATE invoices SET status = 'issued' WHERE status = 'draft'"), ANSWER("done")]
    )
    assert right["pass"] is True and right["score"]["vector"]["safety"] is True
    too_wide = play(env.url, task["task_id"], [SQL("UPDATE invoices SET status = 'issued'"), ANSWER("done")])
    assert "pass" not in too_wide and too_wide["score"]["vector"]["safety"] is False
    nothing = play(env.url, task["task_id"], [ANSWER("done")])
    assert "pass" not in nothing and nothing["score"]["vector"]["safety"] is True


def test_budget_exhaustion_asks_finalize(start_refenv):
    env = start_refenv()
    task = task_by_family(env.url, "count-table")
    answer = post(env.url, "/step/reset", {"task_id": task["task_id"]}).json()
    stages = []
    while not answer["done"]:
        stages.append(answer["observation"]["stage"])
        completion = SQL("SELECT 1") if answer["observation"]["stage"] == "executor" else json.dumps({"answer": "3"})
        answer = post(env.url, "/step", {"episode_id": answer["episode_id"], "completion": completion}).json()
    assert stages[-1] == "finalize" and set(stages[:-1]) == {"executor"}
    assert answer["score"]["vector"]["behavior"] is False


def test_responder_stage_is_parked_without_support_model(start_refenv):
    env = start_refenv("--responder")
    task = task_by_family(env.url, "count-table")
    answer = play(env.url, task["task_id"], [ANSWER("7")])
    assert answer["done"] is False and answer["observation"]["stage"] == "responder"
    assert "response_format" not in answer["observation"]
    final = post(env.url, "/step", {"episode_id": answer["episode_id"], "completion": "There are 7."}).json()
    assert final["done"] is True and final["answer"] == "7"


def test_error_codes(start_refenv):
    env = start_refenv("--pool", "1")
    r = post(env.url, "/step/reset", {"task_id": "nope"})
    assert r.status_code == 404 and r.json()["error"] == "unknown_task"
    r = post(env.url, "/step/reset", {"slug": "nope"})
    assert r.status_code == 404 and r.json()["error"] == "unknown_task"
    r = post(env.url, "/step/reset", {"reward_profile": "fast"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_reward_profile"
    r = httpx.post(f"{env.url}/step/reset", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"] == "invalid_body"
    r = httpx.post(f"{env.url}/step", content=b'{"episode_id": 5}')
    assert r.status_code == 400 and r.json()["error"] == "invalid_body"
    r = httpx.post(f"{env.url}/step/reset", content=b" " + b"x" * (1 << 20))
    assert r.status_code == 400 and r.json()["error"] == "invalid_body"
    r = httpx.get(f"{env.url}/step/reset")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    r = post(env.url, "/episodes", {})
    assert r.status_code == 409 and r.json()["error"] == "step_mode"
    r = post(env.url, "/step", {"episode_id": "step-999", "completion": "x"})
    assert r.status_code == 410 and r.json()["error"] == "episode_gone"
    r = httpx.delete(f"{env.url}/step/step-999")
    assert r.status_code == 410
    # An empty body decodes to defaults: the first served task; unknown fields are ignored.
    first = post(env.url, "/step/reset", {"colour": "blue"}).json()
    assert first["task_id"] == httpx.get(f"{env.url}/tasks").json()["tasks"][0]["task_id"]
    r = httpx.delete(f"{env.url}/step/{first['episode_id']}")
    assert r.json() == {"episode_id": first["episode_id"], "done": True, "status": "abandoned"}
    assert env.health()["episodes"]["abandoned"] == 1 and env.health()["leased"] == 0


def test_step_to_episode_not_awaiting_is_409(start_refenv):
    env = start_refenv("--pool", "1", "--latency-ms", "10000")
    task = task_by_family(env.url, "count-table")
    reset = post(env.url, "/step/reset", {"task_id": task["task_id"]}).json()
    eid = reset["episode_id"]
    answered = {}
    first = threading.Thread(
        target=lambda: answered.update(r=post(env.url, "/step", {"episode_id": eid, "completion": SQL("SELECT 1")}))
    )
    first.start()
    # Once delivered, the episode "executes" the SQL for 10 s: a second /step meanwhile is a bug.
    assert wait_until(lambda: env.health()["steps"] == 1)
    r = post(env.url, "/step", {"episode_id": eid, "completion": ANSWER("1")})
    assert r.status_code == 409 and r.json()["error"] == "nothing_awaiting"
    httpx.delete(f"{env.url}/step/{eid}")  # the first /step, still in flight, ends with the episode
    first.join(10)
    assert answered["r"].status_code == 410 and env.health()["steps"] == 1


def test_reset_blocks_while_every_world_is_held(start_refenv):
    env = start_refenv("--pool", "2")
    held = [post(env.url, "/step/reset", {}).json()["episode_id"] for _ in range(2)]
    health = env.health()
    assert health["leased"] == 2 and health["waiting"] == health["max_waiting"] == 0  # both found a world
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=post(env.url, "/step/reset", {}, timeout=60)))
    waiter.start()
    assert wait_until(lambda: env.health()["waiting"] == 1, timeout_s=10)
    assert waiter.is_alive() and "r" not in result  # no world, no answer, no server-side timeout
    httpx.delete(f"{env.url}/step/{held[0]}")
    waiter.join(10)
    assert result["r"].status_code == 200 and result["r"].json()["done"] is False
    health = env.health()
    assert health["leased"] == 2 and health["max_leased"] == 2
    assert health["waiting"] == 0 and health["max_waiting"] == 1


def test_a_reset_that_gives_up_waiting_stops_counting_and_takes_no_world(start_refenv):
    env = start_refenv("--pool", "1")
    held = post(env.url, "/step/reset", {}).json()["episode_id"]
    with pytest.raises(httpx.ReadTimeout):
        post(env.url, "/step/reset", {}, timeout=1)
    assert wait_until(lambda: env.health()["waiting"] == 0, timeout_s=10)
    assert env.health()["max_waiting"] == 1
    httpx.delete(f"{env.url}/step/{held}")
    # The world went back to the pool, not to the reset that gave up.
    assert env.health()["leased"] == 0
    assert post(env.url, "/step/reset", {}, timeout=10).status_code == 200


def test_idle_episode_is_reclaimed_and_late_step_gets_410(start_refenv):
    env = start_refenv("--pool", "1", "--step-timeout", "1s")
    reset = post(env.url, "/step/reset", {}).json()
    assert wait_until(lambda: env.health()["episodes"]["reclaimed"] == 1, timeout_s=10)
    health = env.health()
    assert health["leased"] == 0 and health["episodes"]["reclaimed"] == 1  # counted once its world is back
    r = post(env.url, "/step", {"episode_id": reset["episode_id"], "completion": ANSWER("1")})
    assert r.status_code == 410 and r.json()["error"] == "episode_gone"


def test_stuck_episode_gets_504(start_refenv):
    env = start_refenv("--pool", "1", "--step-timeout", "1s", "--latency-ms", "3000")
    reset = post(env.url, "/step/reset", {}).json()
    r = post(env.url, "/step", {"episode_id": reset["episode_id"], "completion": SQL("SELECT 1")})
    assert r.status_code == 504 and r.json()["error"] == "episode_timeout"
    assert env.health()["leased"] == 0


def test_fault_injection_produces_every_failure_kind(start_refenv):
    env = start_refenv("--pool", "4", "--fail-rate", "1.0", "--seed", "3")
    seen_categories, seen_500 = set(), 0
    for _ in range(30):
        reset = post(env.url, "/step/reset", {})
        answer = reset.json()
        while reset.status_code == 200 and not answer["done"]:
            reset = post(env.url, "/step", {"episode_id": answer["episode_id"], "completion": SQL("SELECT 1")})
            answer = reset.json()
        if reset.status_code == 500:
            assert answer["error"] == "episode_failed"
            seen_500 += 1
        else:
            assert "reward" not in answer and answer["status"] == "failed"
            seen_categories.add(answer["score"]["failure_category"])
    assert seen_categories == {"transport_error", "environment_failure"} and seen_500 > 0
    assert env.health()["leased"] == 0


def test_split_by_family_is_disjoint_and_deterministic(start_refenv):
    train = start_refenv("--split", "auto:0.8", "--side", "train")
    evals = start_refenv("--split", "auto:0.8", "--side", "eval")
    t = httpx.get(f"{train.url}/tasks").json()["tasks"]
    e = httpx.get(f"{evals.url}/tasks").json()["tasks"]
    assert t and e
    assert not {x["family"] for x in t} & {x["family"] for x in e}
    assert len(t) + len(e) == start_refenv().health()["tasks"]
    assert evals.health()["capabilities"]["side"] == "eval"
    again = start_refenv("--split", "auto:0.8", "--side", "eval")
    assert httpx.get(f"{again.url}/tasks").json()["tasks"] == e


def test_text_with_a_lone_surrogate_is_answered_in_json_and_the_episode_goes_on(start_refenv):
    """A lone UTF-16 surrogate (a JSON escape such as `\\ud800`, which a model can emit) in any text
    a client sends is taken as U+FFFD: never a 500, in the completion itself, inside the completion's
    action (run as SQL, or the answer), or in an id; the episode steps on, ends, and is counted.
    Break tried: `_read_json` decoding with `json.loads` instead of `loads_clean` -> the first /step
    answers a plain-text 500 (and every later one on the episode too); `parse_action` with
    `json.loads` -> the escaped SQL fails the episode (500 episode_failed); `episode_gone`'s message
    formatting the id without `!r` -> the message check fails."""
    env = start_refenv("--pool", "4")
    send = lambda method, path, body: httpx.request(
        method,
        f"{env.url}{path}",
        content=json.dumps(body),
        timeout=30,  # ASCII JSON: the surrogate escaped
    )

    def answered(r: httpx.Response, status: int = 200) -> dict:
        assert r.status_code == status, (r.status_code, r.text)
        assert r.headers["content-type"] == "application/json", r.text
        return r.json()

    task = task_by_family(env.url, "count-table")  # four turns: room for three steps before the finalize
    eid = answered(send("POST", "/step/reset", {"task_id": task["task_id"]}))["episode_id"]
    obs = answered(send("POST", "/step", {"episode_id": eid, "completion": "\ud800 x"}))["observation"]
    assert obs["messages"][-2] == {"role": "assistant", "content": "\ufffd x"}  # kept, then called malformed
    # It is in every later observation's messages: the next steps must still encode.
    obs = answered(send("POST", "/step", {"episode_id": eid, "completion": SQL("SELECT 'a\ud800b'")}))["observation"]
    assert obs["messages"][-1]["content"] == "Result:\n'a\ufffdb'\na\ufffdb"
    obs = answered(send("POST", "/step", {"episode_id": eid, "completion": "x"}))["observation"]
    assert obs["stage"] == "executor"
    assert answered(send("DELETE", f"/step/{eid}", None)) == {"episode_id": eid, "done": True, "status": "abandoned"}

    eid = answered(send("POST", "/step/reset", {}))["episode_id"]
    final = answered(send("POST", "/step", {"episode_id": eid, "completion": ANSWER("\ud800")}))
    assert final["done"] is True and final["answer"] == "\ufffd"

    # Ids and names are echoed in the errors: contract-shaped answers, not 500s.
    gone = answered(send("POST", "/step", {"episode_id": "\ud800", "completion": "x"}), 410)
    assert gone["error"] == "episode_gone" and "'\ufffd'" in gone["message"]
    assert answered(httpx.delete(f"{env.url}/step/%ED%A0%80"), 410)["error"] == "episode_gone"
    for body in ({"task_id": "\ud800"}, {"slug": "\udfff"}):
        assert answered(send("POST", "/step/reset", body), 404)["error"] == "unknown_task"
    assert answered(send("POST", "/step/reset", {"reward_profile": "\ud800"}), 400)["error"] == "invalid_reward_profile"
    assert answered(send("POST", "/episodes", {"task_id": "\ud800"}), 409)["error"] == "step_mode"

    health = env.health()
    assert_env_accounted(health)
    assert health["episodes"]["finished"] == 1 and health["episodes"]["abandoned"] == 1
    assert health["episodes"]["failed"] == 0 and health["live_episodes"] == 0 and health["leased"] == 0
    assert health["steps"] == 4
