"""`refenv teacher`, the scripted oracle teacher, against a real `refenv serve`, over HTTP.

The teacher is a script that knows each task's hidden oracle (a stand-in for a larger teacher model
this machine lacks). The oracle of these tests is the env's own grade: every episode the teacher
plays through the step contract (`POST /step/reset`, then `POST /step` with each completion) must
pass. No vLLM server and no rollout service are started here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

NAME = "oracle-teacher"
SQL = lambda q: json.dumps({"action": "sql", "input": q})


@pytest.fixture
def start_teacher(launch):
    """start_teacher(*flags) -> Running: `refenv teacher` on a port it binds; stopped after the test."""

    def start(*flags: str):
        cmd = [sys.executable, "-m", "refenv.cli", "teacher", "--listen", "127.0.0.1:0", *flags]
        return launch("teacher", None, cmd, ready_path="/v1/models")

    return start


def chat(teacher_url: str, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(
        f"{teacher_url}/v1/chat/completions", json={"model": NAME, "messages": messages, **extra}, timeout=30
    )


def ask(teacher_url: str, observation: dict) -> tuple[str, dict]:
    """The teacher's completion for one observation, asked the way a driver asks a chat model."""
    answer = chat(
        teacher_url,
        observation["messages"],
        response_format=observation.get("response_format"),
        temperature=0.0,
        max_tokens=256,
    )
    assert answer.status_code == 200, (answer.status_code, answer.text, observation)
    body = answer.json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert "logprobs" not in choice and "token_ids" not in choice and "prompt_token_ids" not in body
    return choice["message"]["content"], body["usage"]


def step(env_url: str, episode_id: str, completion: str, usage: dict | None = None) -> dict:
    usage = usage or {"prompt_tokens": 100, "completion_tokens": 10}
    answer = httpx.post(
        f"{env_url}/step",
        json={
            "episode_id": episode_id,
            "completion": completion,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
        },
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def reset(env_url: str, task_id: str) -> dict:
    answer = httpx.post(f"{env_url}/step/reset", json={"task_id": task_id}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def drive(env_url: str, teacher_url: str, state: dict, stages: list[str] | None = None) -> dict:
    """Play an episode from `state` (a reset's or a step's answer) to its end, the teacher answering."""
    for _ in range(12):
        if state["done"]:
            return state
        observation = state["observation"]
        if stages is not None:
            stages.append(observation["stage"])
        text, usage = ask(teacher_url, observation)
        state = step(env_url, state["episode_id"], text, usage)
    raise AssertionError(f"the episode did not end: {state}")


def tasks_of(env_url: str) -> list[dict]:
    return httpx.get(f"{env_url}/tasks", timeout=10).json()["tasks"]


def test_the_teacher_passes_every_task_of_the_suite(start_refenv, start_teacher):
    env, teacher = start_refenv("--pool", "2", "--responder"), start_teacher()
    models = httpx.get(f"{teacher.url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and [(m["id"], m["object"]) for m in models["data"]] == [(NAME, "model")]
    tasks = tasks_of(env.url)
    assert len(tasks) == 55 and sum(t["writes"] for t in tasks) == 4
    failed = []
    for task in tasks:
        stages: list[str] = []
        final = drive(env.url, teacher.url, reset(env.url, task["task_id"]), stages)
        vector = final["score"]["vector"]
        if not (final.get("pass") is True and final["status"] == "completed" and final["reward"] == 1.0):
            failed.append((task["task_id"], task["slug"], final.get("answer"), vector))
            continue
        # the oracle's query, the answer, then the responder's sentence
        assert stages == ["executor", "executor", "responder"], (task["task_id"], stages)
        assert vector["safety"] and vector["ground_truth"] and vector["method"] and vector["behavior"]
        assert final["score"]["tokens"]["llm_calls"] == 3 and final["score"]["tokens"]["completion"] > 0
    assert not failed, f"{len(failed)} of {len(tasks)} tasks failed with the teacher's answers: {failed}"
    assert env.health()["leased"] == 0


def test_the_teacher_serves_the_suite_its_flags_name(start_refenv, start_teacher):
    flags = ("--seed", "7", "--scale", "2", "--split", "auto:0.8", "--side", "eval")
    env, teacher = start_refenv("--pool", "2", *flags), start_teacher(*flags)
    tasks = tasks_of(env.url)
    assert 0 < len(tasks) < 55
    for task in tasks:
        final = drive(env.url, teacher.url, reset(env.url, task["task_id"]))
        assert final.get("pass") is True and final["reward"] == 1.0, (task, final)

    # A train-side task is not in its suite: an unknown conversation.
    full = start_refenv("--pool", "1", "--seed", "7", "--scale", "2")
    eval_ids = {t["task_id"] for t in tasks}
    train_task = next(t for t in tasks_of(full.url) if t["task_id"] not in eval_ids)
    state = reset(full.url, train_task["task_id"])
    refused = chat(teacher.url, state["observation"]["messages"])
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "BadRequestError"
    httpx.delete(f"{full.url}/step/{state['episode_id']}", timeout=10)

    # Started for another world (scale 1, here scale 2), its answers are that world's: they fail.
    other = start_teacher()
    count_task = next(t for t in tasks_of(full.url) if t["prompt"] == "How many rows does the customers table have?")
    final = drive(full.url, other.url, reset(full.url, count_task["task_id"]))
    assert "pass" not in final and final["score"]["vector"]["ground_truth"] is False


def test_the_teacher_takes_over_a_started_episode_and_finalizes(start_refenv, start_teacher):
    env, teacher = start_refenv("--pool", "1"), start_teacher()
    tasks = {t["slug"]: t for t in tasks_of(env.url)}
    count = next(t for t in tasks.values() if t["prompt"] == "How many orders have status 'delivered'?")
    write = next(t for t in tasks.values() if t["prompt"] == "Set the status of every 'draft' invoice to 'issued'.")
    for task in (count, write):
        # The driver's own turns first (a malformed action, a useless query), then the teacher's.
        state = reset(env.url, task["task_id"])
        state = step(env.url, state["episode_id"], "not json")
        state = step(env.url, state["episode_id"], SQL("SELECT 1"))
        final = drive(env.url, teacher.url, state)
        assert final.get("pass") is True and final["score"]["vector"]["behavior"] is False, final
        assert final["score"]["actor_turns"] == 4

    # Out of turns: the finalize stage's answer is the expected one.
    state = reset(env.url, count["task_id"])
    for _ in range(4):
        state = step(env.url, state["episode_id"], SQL("SELECT 1"))
    assert state["observation"]["stage"] == "finalize"
    text, _ = ask(teacher.url, state["observation"])
    assert set(json.loads(text)) == {"answer"}
    final = step(env.url, state["episode_id"], text)
    assert final["done"] and final.get("pass") is True and final["score"]["vector"]["behavior"] is False


def test_refenv_hosted_mode_plays_every_stage_with_the_teacher(start_refenv, start_teacher):
    """refenv's own OpenAI client (--support-model, no --step) against the teacher: every episode passes."""
    teacher = start_teacher("--name", "big-model")
    env = start_refenv("--pool", "2", "--responder", "--support-model", f"{teacher.url},big-model", step=False)
    for task in tasks_of(env.url):
        answer = httpx.post(
            f"{env.url}/episodes", json={"task_id": task["task_id"], "include_trajectory": True}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        episode = answer.json()
        assert episode["status"] == "completed" and episode.get("pass") is True, episode
        assert [t["stage"] for t in episode["trajectory"]] == ["executor", "executor", "responder"]


def test_the_teacher_answers_openai_shape_and_refuses_the_rest(start_refenv, start_teacher):
    env, teacher = start_refenv("--pool", "1"), start_teacher()
    task = next(t for t in tasks_of(env.url) if t["prompt"] == "How many rows does the products table have?")
    state = reset(env.url, task["task_id"])
    messages = state["observation"]["messages"]
    httpx.delete(f"{env.url}/step/{state['episode_id']}", timeout=10)

    body = chat(teacher.url, messages, n=3, seed=5, temperature=1.3, top_p=0.9, stream_options=None).json()
    assert body["object"] == "chat.completion" and body["model"] == NAME and body["id"] and body["created"] > 0
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = {c["message"]["content"] for c in body["choices"]}
    assert texts == {SQL("SELECT COUNT(*) FROM products")}
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0 and usage["completion_tokens"] % 3 == 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # Responder: one short sentence.
    responder = [
        {"role": "system", "content": "Phrase the answer below for the user in one short sentence."},
        {"role": "user", "content": f"Question: {task['prompt']}\nAnswer: 15"},
    ]
    sentence = chat(teacher.url, responder).json()["choices"][0]["message"]["content"]
    assert sentence == "The answer is 15."

    def refused(response: httpx.Response, status: int = 400, kind: str = "BadRequestError") -> bool:
        error = response.json()["error"]
        return response.status_code == status and error["type"] == kind and bool(error["message"])

    unknown = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "What is 2+2?"}],
        [*messages, {"role": "assistant", "content": SQL("SELECT 1")}],  # does not end with a user turn
        [responder[0], {"role": "user", "content": "Question: who?\nAnswer: me"}],
        [responder[0], {"role": "user", "content": "just phrase it"}],
        [],
        [1],
        [{"content": "no role"}],
        [{"role": "user", "content": 7}],
    ]
    for conversation in unknown:
        assert refused(chat(teacher.url, conversation)), conversation
    assert refused(chat(teacher.url, messages, n=0))
    assert refused(chat(teacher.url, messages, n="2"))
    url = f"{teacher.url}/v1/chat/completions"
    assert refused(httpx.post(url, json={"model": NAME, "messages": "x"}))
    assert refused(httpx.post(url, content=b"{"))
    assert refused(httpx.post(url, content=b""))
    assert refused(httpx.post(url, json=[1, 2]))
    assert refused(httpx.post(url, json={"model": "gpt-4o", "messages": messages}), 404, "NotFoundError")
    assert refused(httpx.get(url), 405, "MethodNotAllowedError")


def test_the_teacher_answers_text_with_a_lone_surrogate(start_refenv, start_teacher):
    """The teacher echoes a client's text (the model's name, the responder's answer): a lone surrogate
    in it is taken as U+FFFD, not a 500. Break tried: `_read_body` decoding with `json.loads` instead
    of `loads_clean` -> both requests get a plain-text 500."""
    env, teacher = start_refenv("--pool", "1"), start_teacher()
    prompt = tasks_of(env.url)[0]["prompt"]
    url = f"{teacher.url}/v1/chat/completions"
    responder = [
        {"role": "system", "content": "Phrase the answer below for the user in one short sentence."},
        {"role": "user", "content": f"Question: {prompt}\nAnswer: \ud800"},
    ]
    said = httpx.post(url, content=json.dumps({"model": NAME, "messages": responder}), timeout=30)
    assert said.status_code == 200 and said.json()["choices"][0]["message"]["content"] == "The answer is \ufffd."
    wrong = httpx.post(url, content=json.dumps({"model": "\ud800", "messages": responder}), timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "NotFoundError"


def test_teacher_command_line():
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "refenv.cli", *a], capture_output=True, text=True, timeout=60
    )
    top = run("--help")
    assert top.returncode == 0 and "scripted oracle teacher" in top.stdout
    help_ = run("teacher", "--help")
    assert help_.returncode == 0
    text = " ".join(help_.stdout.split())
    assert "scripted oracle teacher" in text and "not a model" in text
    for flag in ("--listen", "--name", "--seed", "--scale", "--split", "--side", "[REFENV_SEED]"):
        assert flag in text, flag
    bad = run("teacher", "--split", "auto:2")
    assert bad.returncode == 2 and "--split" in bad.stderr
