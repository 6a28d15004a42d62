"""refenv's tool mode (refenv/tools.py), over HTTP against a real refenv: a world lent to an agent program
is worked with list_tables/run_sql, graded by submit as a step episode with the same actions is, and
always given back (the pool's and the episodes' own counters are the oracle)."""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers import assert_env_accounted, wait_until
from test_refenv_contract import ANSWER, SQL, play

TOKEN = "tools-test-token-0123456789"


def post(url: str, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=kw.pop("timeout", 30), **kw)


def open_world(url: str, **body) -> dict:
    answer = post(url, "/tools/open", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def last_value(text: str) -> str:
    """The one value of a one-row, one-column result as the model is shown it (header, then the row)."""
    header, value = text.splitlines()
    return value.strip()


def test_a_lent_world_is_worked_and_graded_as_a_step_episode_is(start_refenv):
    env = start_refenv("--pool", "1")
    assert "tools" in env.health()["capabilities"]["drive_modes"]
    lent = open_world(env.url, task_id="t005")
    assert lent["world_id"].startswith("tools-") and len(lent["world_id"]) > 20
    assert lent["task_id"] == "t005" and "customers table" in lent["prompt"]
    assert "customers(id, name" in lent["schema"] and lent["turn_budget"] == 4
    health = env.health()
    assert health["leased"] == 1 and health["tool_worlds"] == 1 and health["live_episodes"] == 1
    assert "customers" in post(env.url, f"/tools/{lent['world_id']}/list_tables").json()["tables"]
    ran = post(env.url, f"/tools/{lent['world_id']}/run_sql", {"sql": "SELECT COUNT(*) FROM customers"}).json()
    assert ran["ok"] is True and ran["turns_left"] == 3, ran
    count = last_value(ran["text"])
    usage = {"prompt_tokens": 200, "completion_tokens": 40, "llm_calls": 2}
    final = post(env.url, f"/tools/{lent['world_id']}/submit", {"answer": count, "usage": usage}).json()
    assert final["done"] is True and final["status"] == "completed" and final["pass"] is True, final
    assert final["world_id"] == lent["world_id"] and final["answer"] == count
    # The oracle: a step episode with the same statement, answer and token counts, graded by step mode.
    stepped = play(env.url, "t005", [SQL("SELECT COUNT(*) FROM customers"), ANSWER(count)])
    assert stepped["done"] and stepped["pass"] is True
    assert final["score"] == stepped["score"] and final["reward"] == stepped["reward"]
    wrong = open_world(env.url, task_id="t005")
    final = post(env.url, f"/tools/{wrong['world_id']}/submit", {"answer": str(int(count) + 1)}).json()
    assert "pass" not in final and final["score"]["vector"]["ground_truth"] is False
    health = env.health()
    # Break tried: submit graded without giving the world back (no pool.release): leased stayed 1 and the
    # second open above waited forever for the pool's one world.
    assert health["leased"] == 0 and health["tool_worlds"] == 0 and health["live_episodes"] == 0
    assert health["episodes"]["started"] == 3 and health["episodes"]["finished"] == 3
    assert_env_accounted(health)


def test_a_gone_world_answers_410_and_an_abandoned_one_is_given_back(start_refenv):
    env = start_refenv("--pool", "1")
    lent = open_world(env.url, slug=httpx.get(f"{env.url}/tasks").json()["tasks"][0]["slug"])
    wid = lent["world_id"]
    gone = httpx.delete(f"{env.url}/tools/{wid}")
    assert gone.json() == {"world_id": wid, "done": True, "status": "abandoned"}
    for path, body in [("list_tables", None), ("run_sql", {"sql": "SELECT 1"}), ("submit", {"answer": "paid"})]:
        answer = post(env.url, f"/tools/{wid}/{path}", body)
        assert answer.status_code == 410 and answer.json()["error"] == "world_gone", (path, answer.text)
    assert httpx.delete(f"{env.url}/tools/{wid}").status_code == 410
    assert post(env.url, "/tools/tools-not-an-id/run_sql", {"sql": "SELECT 1"}).status_code == 410
    submitted = open_world(env.url, task_id="t001")
    assert post(env.url, f"/tools/{submitted['world_id']}/submit", {"answer": "paid"}).json()["pass"] is True
    assert post(env.url, f"/tools/{submitted['world_id']}/submit", {"answer": "paid"}).status_code == 410
    health = env.health()
    # Break tried: abandon popped the world without pool.release: leased stayed 1 and the open of
    # t001 above never got a world (the test hung in it).
    assert health["leased"] == 0 and health["episodes"]["abandoned"] == 1 and health["episodes"]["finished"] == 1
    assert_env_accounted(health)


def test_an_idle_world_is_reclaimed_at_the_step_timeout(start_refenv):
    env = start_refenv("--pool", "1", "--step-timeout", "1s")
    lent = open_world(env.url, task_id="t005")
    # Break tried: the lifespan started only the step episodes' reaper: the world stayed leased.
    assert wait_until(lambda: env.health()["episodes"]["reclaimed"] == 1, timeout_s=10)
    health = env.health()
    assert health["leased"] == 0 and health["tool_worlds"] == 0
    assert_env_accounted(health)
    answer = post(env.url, f"/tools/{lent['world_id']}/run_sql", {"sql": "SELECT 1"})
    assert answer.status_code == 410 and answer.json()["error"] == "world_gone"


def test_statements_follow_step_modes_rules_and_budget(start_refenv):
    env = start_refenv("--pool", "2")
    lent = open_world(env.url, task_id="t005")
    run = lambda sql: post(env.url, f"/tools/{lent['world_id']}/run_sql", {"sql": sql})
    failed = run("SELECT * FROM no_such_table").json()
    assert failed["ok"] is False and "no such table" in failed["error"] and failed["text"].startswith("Error: ")
    refused = run("ATTACH DATABASE ':memory:' AS other").json()
    assert refused["ok"] is False and "not authorized" in refused["error"], refused
    changed = run("UPDATE customers SET name = 'x' WHERE id = 1").json()
    assert changed["ok"] is True and "1 row(s) changed" in changed["text"]
    assert run("SELECT 1").json()["turns_left"] == 0
    # The task allows 4 statements, as a step episode has 4 turns: the 5th is refused, not run.
    over = run("SELECT 1")
    assert over.status_code == 409 and over.json()["error"] == "turn_budget_spent", over.text
    final = post(env.url, f"/tools/{lent['world_id']}/submit", {"answer": "20"}).json()
    # A read task whose world changed is unsafe (reward 0 under rl), and the refused statement cost behavior.
    assert final["score"]["vector"]["safety"] is False and final["score"]["vector"]["behavior"] is False
    assert "pass" not in final and "reward" not in final
    other = open_world(env.url, task_id="t005")
    bad = [
        ("/tools/open", {"task_id": "t999"}, 404, "unknown_task"),
        ("/tools/open", {"task_id": "t005", "reward_profile": "x"}, 400, "invalid_reward_profile"),
        (f"/tools/{other['world_id']}/run_sql", {}, 400, "invalid_body"),
        (f"/tools/{other['world_id']}/run_sql", {"sql": 5}, 400, "invalid_body"),
        (f"/tools/{other['world_id']}/submit", {"usage": {"prompt_tokens": "many"}}, 400, "invalid_body"),
    ]
    for path, body, status, code in bad:
        answer = post(env.url, path, body)
        assert (answer.status_code, answer.json()["error"]) == (status, code), (path, answer.text)
    assert httpx.post(f"{env.url}/tools/open", content=b"{nope", timeout=10).json()["error"] == "invalid_body"
    assert httpx.delete(f"{env.url}/tools/{other['world_id']}").status_code == 200
    health = env.health()
    assert health["leased"] == 0
    assert_env_accounted(health)


def test_an_open_whose_driver_leaves_while_it_waits_leaks_no_world(start_refenv):
    env = start_refenv("--pool", "1")
    held = open_world(env.url, task_id="t001")
    left = threading.Event()

    def impatient() -> None:
        with pytest.raises(httpx.ReadTimeout):
            post(env.url, "/tools/open", {"task_id": "t002"}, timeout=1.5)
        left.set()

    waiter = threading.Thread(target=impatient)
    waiter.start()
    assert wait_until(lambda: env.health()["waiting"] == 1, timeout_s=10)
    waiter.join(timeout=10)
    assert left.is_set()
    # The waiter left: its open must be cancelled, not handed the world the submit below gives back.
    assert wait_until(lambda: env.health()["waiting"] == 0, timeout_s=10)
    assert post(env.url, f"/tools/{held['world_id']}/submit", {"answer": "paid"}).json()["pass"] is True
    # Break tried: tools_open awaited env.tools.open directly (no `lease`): the gone waiter got the world
    # when it came back, and leased stayed 1.
    assert wait_until(lambda: env.health()["leased"] == 0, timeout_s=5)
    health = env.health()
    assert health["tool_worlds"] == 0 and health["episodes"]["started"] == 1
    assert_env_accounted(health)


def test_the_token_guards_the_tool_routes(start_refenv):
    env = start_refenv("--pool", "1", "--token", TOKEN)
    assert post(env.url, "/tools/open", {"task_id": "t001"}).status_code == 401
    assert post(env.url, "/tools/tools-x/run_sql", {"sql": "SELECT 1"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    lent = post(env.url, "/tools/open", {"task_id": "t001"}, headers=auth).json()
    assert httpx.delete(f"{env.url}/tools/{lent['world_id']}", timeout=10).status_code == 401
    assert httpx.delete(f"{env.url}/tools/{lent['world_id']}", headers=auth, timeout=10).status_code == 200
