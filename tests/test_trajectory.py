"""Exact trajectories on the real CPU vLLM and the real refenv.

Oracles outside the code under test: the turn records as the model server returned them (their
own prompt and completion ids), the tokenizer of the model files (`transformers`), which
decodes the ids back to the text the env saw, the model itself in `transformers` (float32), which
recomputes each sampled token's logprob from the segment's ids, and the service's `--policy-stage`
(which stages are trainable), not the turns' own flag.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from helpers import assert_accounted, assert_logprobs_are_the_policys
from httpx_stand_in import stand_in

from rollout_service.backends.json_body import dumps
from rollout_service.launch import embedded_model
from rollout_service.protocol import Attempt, GroupResult
from rollout_service.server.groups.group_json import group_json, one_line
from rollout_service.trainer import token_batch, trl_rollout

POLICY_STAGES = {"executor"}  # the service's default --policy-stage


@cache
def model_dir() -> str:
    return str(embedded_model.cache_dir())


def run_groups(service: str, groups: list[dict]) -> list[dict]:
    answer = httpx.post(f"{service}/groups/batch", json={"groups": groups}, timeout=1200)
    assert answer.status_code == 200, answer.text
    items = [json.loads(line) for line in answer.text.splitlines() if line.strip()]
    results = [item["group"] for item in sorted(items, key=lambda i: i["index"])]
    for group in results:
        assert_accounted(group)
    return results


_RUN: dict[str, Any] = {}
_CONTINUED: dict[str, float] = {}  # the service's rollout_exact_continuations_total after the run, by how


@pytest.fixture
def exact_run(start_refenv, start_service, vllm_url) -> tuple[list[dict], list[dict]]:
    """Constrained groups on refenv with its responder stage (a rewritten history after each answer),
    and an unconstrained group, whose logprobs are the policy's own. Run once for the module (by the
    first test that asks; the processes are per test, the results are not)."""
    if "run" not in _RUN:
        _RUN["run"] = _exact_run(start_refenv, start_service, vllm_url)
    return _RUN["run"]


def _exact_run(start_refenv, start_service, vllm_url: str) -> tuple[list[dict], list[dict]]:
    # Earlier tests changed the weights this session's server serves (and put them back); once, here,
    # its prefix cache held KV computed by other weights and logprobs were 0.2 nats off. The oracle
    # below is about what the logprobs mean, so it starts from an empty cache.
    reset = httpx.post(f"{vllm_url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=60)
    assert reset.json()["success"] is True
    env = start_refenv("--pool", "6", "--responder")
    # The run log holds the service's own bytes for each group (test_results_are_the_json_pydantic_would_write).
    _RUN["log"] = Path(tempfile.mkdtemp(prefix="exact-run-"))
    service = start_service([env.url], "--runs-dir", str(_RUN["log"]))
    tasks = [t["task_id"] for t in httpx.get(f"{env.url}/tasks", timeout=10).json()["tasks"]]
    sampling = {"temperature": 1.0, "max_tokens": 64, "seed": 11}
    constrained = run_groups(
        service.url, [{"task_id": t, "n": 3, "sampling": sampling, "max_turns": 4} for t in tasks[:2]]
    )
    free = run_groups(
        service.url, [{"task_id": tasks[2], "n": 3, "sampling": sampling, "max_turns": 3, "constrained": False}]
    )
    for line in httpx.get(f"{service.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("rollout_exact_continuations_total{"):
            _CONTINUED[line.split('how="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return constrained, free


def attempts_of(groups: list[dict]) -> list[dict]:
    return [a for g in groups for a in g["attempts"] if a["turns"]]


def span_of(attempt: dict, turn: dict) -> tuple[list[int], dict, dict]:
    """A turn's prompt ids as the README says to read them (its segment up to its span), its segment
    and its span."""
    segment = attempt["trajectory"][turn["segment"]]
    [span] = [s for s in segment["turns"] if s["turn"] == turn["index"]]
    return segment["token_ids"][: span["start"]], segment, span


def test_turns_continue_the_sampled_tokens_exactly(exact_run):
    """Within a segment, every turn's prompt is the previous prompt, then the previous completion's
    own ids, then the env's tokens: nothing sampled is tokenized again (in chat mode 19 of 46
    consecutive pairs were not). The oracles: the tokenizer's own chat template render of each turn's
    messages, and vLLM's count of the prompt tokens it generated from; that the segment's ids are the
    very context the model saw is test_logprobs_without_a_constraint_agree_with_transformers's (a
    recomputation from them). Breaks tried: prompt ids written into exact turns again -> fails (they are
    null, read from the trajectory); Attempt.turn_prompt_ids reading segment 0's first span whatever
    the turn -> fails."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    pairs = 0
    for attempt in attempts_of(exact_run[0] + exact_run[1]):
        assert attempt["tokens"] == "exact"
        turns, segments = attempt["turns"], attempt["trajectory"]
        for turn in turns:
            assert turn["prompt_token_ids"] is None, "an exact turn repeats the trajectory's prompt ids"
            prompt, segment, span = span_of(attempt, turn)
            # The ids are the text the env saw: the completion decodes to it, and the prompt to the chat
            # template's text of the turn's messages (end-of-turn tokens and all), which is what vLLM
            # counted.
            assert segment["token_ids"][span["start"] : span["end"]] == turn["completion_token_ids"]
            assert tokenizer.decode(turn["completion_token_ids"], skip_special_tokens=True) == turn["completion"]
            rendered = tokenizer.apply_chat_template(turn["messages"], tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(prompt) == rendered, (attempt["index"], turn["index"])
            assert turn["prompt_tokens"] == len(prompt), (attempt["index"], turn["index"])
            assert Attempt.model_validate(attempt).turn_prompt_ids(turn["index"]) == prompt
        for before, after in zip(turns, turns[1:], strict=False):
            if before["segment"] == after["segment"]:
                pairs += 1
                assert span_of(attempt, before)[2]["end"] <= span_of(attempt, after)[2]["start"]
        for number, segment in enumerate(segments):
            mine = [t for t in turns if t["segment"] == number]
            assert mine, "a segment without a turn"
            assert segment["turns"][-1]["end"] == len(segment["token_ids"])  # ends on the last completion
            assert segment["prompt_tokens"] == mine[0]["prompt_tokens"]
            assert len(segment["loss_mask"]) == len(segment["logprobs"]) == len(segment["token_ids"])
    assert pairs >= 5, f"only {pairs} consecutive turn pairs: the run checked too little"


def test_turns_go_on_without_rendering_the_conversation_so_far_where_they_can(exact_run):
    """On the real vLLM: a turn that goes on from its segment finds the env's new messages in the render
    of the whole conversation after the ids sampled, or after its reply's text tokenized alone, where
    that render confirms it; only otherwise is the conversation so far rendered apart. SmolLM2's
    constrained replies are mostly not sampled as the tokenizer splits them, but the template renders
    them as their text alone (2026-12-02: 1, 13 and 0 of 14 the three ways). Oracle for the count: the results' own
    segments (a turn in its predecessor's segment went on from it); the test above checks that each
    way gave the exact tokens. Break tried: both cheap ways' comparisons always false -> only
    rendered_apart, fails."""
    went_on = sum(
        before["segment"] == after["segment"]
        for attempt in attempts_of(exact_run[0] + exact_run[1])
        for before, after in zip(attempt["turns"], attempt["turns"][1:], strict=False)
    )
    assert went_on >= 5
    assert sum(_CONTINUED.values()) == went_on, _CONTINUED
    assert _CONTINUED.get("from_samples", 0) + _CONTINUED.get("from_reply", 0) > 0, _CONTINUED


def test_loss_mask_covers_exactly_the_trainable_sampled_tokens(exact_run):
    trained = 0
    for attempt in attempts_of(exact_run[0] + exact_run[1]):
        for number, segment in enumerate(attempt["trajectory"]):
            turns = [t for t in attempt["turns"] if t["segment"] == number]
            expected_ids = [i for t in turns if t["stage"] in POLICY_STAGES for i in t["completion_token_ids"]]
            expected_lps = [lp for t in turns if t["stage"] in POLICY_STAGES for lp in t["logprobs"]]
            masked = [i for i, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
            assert masked == expected_ids
            assert [lp for lp, m in zip(segment["logprobs"], segment["loss_mask"], strict=True) if m] == expected_lps
            assert all(lp is None for lp, m in zip(segment["logprobs"], segment["loss_mask"], strict=True) if not m)
            assert set(segment["loss_mask"]) <= {0, 1}
            trained += len(masked)
    assert trained > 0


def test_a_rewritten_history_cuts_a_segment_and_says_so(exact_run):
    """refenv's responder stage starts a new conversation after the answer: its turn is the first of
    a second segment, cut as history_rewritten, and its tokens are not trained (not a policy stage)."""
    cut = 0
    for attempt in attempts_of(exact_run[0]):
        segments = attempt["trajectory"]
        assert segments[0]["cut"] is None
        responder = [t for t in attempt["turns"] if t["stage"] == "responder"]
        assert len(segments) == 1 + len(responder)
        for turn in responder:
            segment = segments[turn["segment"]]
            assert segment["cut"] == "history_rewritten" and segment["cut_detail"]
            assert segment["prompt_tokens"] == turn["prompt_tokens"] == span_of(attempt, turn)[2]["start"]
            assert not any(segment["loss_mask"])
            cut += 1
    assert cut > 0, "no attempt reached the responder stage: nothing was cut"


def test_logprobs_without_a_constraint_agree_with_transformers(exact_run):
    """Unconstrained turns' logprobs are the policy's own (helpers.assert_logprobs_are_the_policys)."""
    attempts = attempts_of(exact_run[1])
    assert all(not t["constrained"] for a in attempts for t in a["turns"])
    assert_logprobs_are_the_policys(attempts)


def test_trainer_shapes(exact_run):
    """TRL's rollout_func shape (as GRPOTrainer 1.16 validates it: prompt_ids, completion_ids, logprobs,
    with env_mask aligned to completion_ids) and the padded batch."""
    attempts = [Attempt.model_validate(a) for a in attempts_of(exact_run[1])]
    # An attempt the infrastructure failed before its first turn: TRL still needs its place in the group.
    failed = Attempt(index=len(attempts), status="env_failure", tokens="exact")
    out = trl_rollout([*attempts, failed], eos_token_id=2)
    assert {"prompt_ids", "completion_ids", "logprobs", "env_mask"} <= out.keys()
    assert out["completion_ids"][-1] == [2] and out["env_mask"][-1] == [0] and out["advantage"][-1] is None
    for a, prompt, completion, lps, mask in zip(
        attempts, out["prompt_ids"], out["completion_ids"], out["logprobs"], out["env_mask"], strict=False
    ):
        if a.advantage is None:
            assert mask == [0]
            continue
        segment = a.trajectory[0]
        assert prompt + completion == segment.token_ids
        assert prompt == a.turn_prompt_ids(0) == segment.token_ids[: segment.turns[0].start]
        spanless = a.model_copy(deep=True)
        spanless.trajectory[0].turns = spanless.trajectory[0].turns[1:]
        with pytest.raises(ValueError, match="has no span"):
            spanless.turn_prompt_ids(0)
        assert len(lps) == len(mask) == len(completion)
        assert sum(mask) == sum(len(t.completion_token_ids) for t in a.turns if t.stage in POLICY_STAGES)
    batch = token_batch([*attempts, failed], pad_token_id=0)
    rows = [s for a in attempts if a.advantage is not None for s in a.trajectory if any(s.loss_mask)]
    assert batch["input_ids"].shape[0] == len(rows)
    for row, segment in enumerate(rows):
        n = len(segment.token_ids)
        assert batch["input_ids"][row, :n].tolist() == segment.token_ids
        assert batch["loss_mask"][row].sum() == sum(segment.loss_mask)
        assert batch["attention_mask"][row].sum() == n


def test_results_are_the_json_pydantic_would_write(exact_run):
    """The service writes results with orjson (server/groups/group_json.py); pydantic's own serialiser is the
    oracle: each result, read back and written by pydantic, is the same JSON byte for byte (the same
    keys, aliases such as `pass`, numbers written alike). What orjson cannot write goes through pydantic. Breaks
    tried: field names instead of aliases -> `pass_` found, fails; no fallback -> TypeError on the
    seed below; a JsonList's JSON with a space after each comma -> the run log's lines differ, fails."""
    groups = exact_run[0] + exact_run[1]
    assert any(a["pass"] is not None for g in groups for a in g["attempts"])  # `pass` is aliased
    # The service's own bytes (prompts and trajectories written as they grew: transport.JsonList).
    (log,) = _RUN["log"].glob("*.jsonl")
    written = log.read_bytes().splitlines()
    assert len(written) == len(groups)
    for line in written:
        assert line == one_line(GroupResult.model_validate_json(line).model_dump_json(by_alias=True).encode())
    for group in groups:
        result = GroupResult.model_validate(group)
        # Byte for byte (parsed JSON would take true for 1 and 0 for 0.0), and the service's own JSON.
        assert group_json(result) == one_line(result.model_dump_json(by_alias=True).encode())
        assert json.loads(group_json(result)) == group
    result = GroupResult.model_validate(groups[0])
    result.sampling["seed"] = 2**70  # past orjson's 64-bit integers
    assert group_json(result) == one_line(result.model_dump_json(by_alias=True).encode())
    assert json.loads(group_json(result))["sampling"]["seed"] == 2**70


def test_chat_mode_has_no_trajectory_and_stop_strings_stay_exact(start_refenv, start_service):
    """tokens: chat works as before. In exact mode a stop string ends the completion but stays in its
    text, and ends the segment: vLLM's ids run to the end of the token the string ended in (here
    `":` for the stop `"input"`), so the next turn starts a segment from the env's messages."""
    from transformers import AutoTokenizer

    env = start_refenv("--pool", "4")
    service = start_service([env.url])
    task = httpx.get(f"{env.url}/tasks", timeout=10).json()["tasks"][0]["task_id"]
    sampling = {"max_tokens": 48, "seed": 3}
    chat, stopped = run_groups(
        service.url,
        [
            {"task_id": task, "n": 2, "tokens": "chat", "max_turns": 2, "sampling": sampling},
            {"task_id": task, "n": 2, "max_turns": 2, "sampling": {**sampling, "stop": ['"input"']}},
        ],
    )
    for attempt in chat["attempts"]:
        assert attempt["tokens"] == "chat" and attempt["trajectory"] is None
        assert all(t["prompt_token_ids"] and t["segment"] is None for t in attempt["turns"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    cuts = 0
    for attempt in stopped["attempts"]:
        turns = attempt["turns"]
        for turn, after in zip(turns, [*turns[1:], None], strict=True):
            decoded = tokenizer.decode(turn["completion_token_ids"], skip_special_tokens=True)
            rendered = tokenizer.apply_chat_template(turn["messages"], tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(span_of(attempt, turn)[0]) == rendered
            if not turn["completion"].endswith('"input"'):
                assert decoded == turn["completion"]
                continue
            assert decoded.startswith(turn["completion"])  # the last token may run past the stop string
            if after is not None:
                assert after["segment"] == turn["segment"] + 1
                assert attempt["trajectory"][after["segment"]]["cut"] == "stop_string"
                cuts += 1
    assert cuts > 0, "no turn ended on the stop string and was followed by another"


def test_a_server_without_token_prompts_gets_chat(start_refenv, start_service, start_scripted_model):
    """A stand-in OpenAI-compatible server with no /tokenize (what vLLM cannot be made to be): turns go
    as chat messages without a trajectory, /health/detail says why, and tokens: exact is refused."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted")
    [group] = run_groups(service.url, [{"task_id": "t001", "n": 2, "sampling": {"seed": 1}}])
    assert {a["tokens"] for a in group["attempts"]} == {"chat"}
    assert all(a["status"] == "scored" and a["trajectory"] is None for a in group["attempts"])
    [server] = httpx.get(f"{service.url}/health/detail", timeout=10).json()["models"]
    assert server["token_prompts"].startswith("no: ") and "404" in server["token_prompts"], server
    refused = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 2, "tokens": "exact"}, timeout=30)
    assert refused.status_code == 422 and refused.json()["error"] == "token_prompts_unsupported", refused.text


# -- how a turn finds the env's new tokens, on a stand-in model server --------------------------
# A stand-in over httpx's MockTransport: a real vLLM cannot be made to tokenize a reply one way or
# another on demand, and the shared server's /tokenize count is other workers' too. Its template is
# ChatML-like, one id per character; its own log of /tokenize calls is the oracle for how many
# renders a turn cost, and `render` below (the template, written apart from the code under test) for
# the ids.
START, END, NL, ASSISTANT, USER, THINK, END_THINK, SYSTEM, TOOL = 1, 2, 3, 4, 5, 6, 7, 8, 9
ROLES = {"assistant": ASSISTANT, "user": USER, "system": SYSTEM, "tool": TOOL}


def _chars(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]


def _render(messages: list[dict], generation_prompt: bool, merge: str | None = None) -> list[int]:
    """The template. `merge` "start": an assistant message that begins with "S" has it tokenized with its
    header (as a BPE may join some replies' start with the newline before them); "end": one that ends
    with "1" has it tokenized with what follows. Either way the reply alone tokenizes otherwise.
    "changed": a conversation that ends with a reply gets a token more. "drops": a reply with more
    after it is rendered without its content. "reasoning" (as Qwen3's and DeepSeek-R1's): the generation
    prompt opens a reasoning block (THINK); the last reply is rendered inside one (THINK, its reasoning,
    END_THINK, its answer); an earlier reply loses its reasoning (the text up to "|"). "hoisting": as
    "reasoning", and every system message is rendered first, wherever it stands (as R1's template does).
    "tool_calls": as "reasoning" (the stand-in server refuses a tool message after a reply without a call)."""
    if merge == "hoisting":
        messages = [m for m in messages if m["role"] == "system"] + [m for m in messages if m["role"] != "system"]
    if merge in ("hoisting", "tool_calls"):
        merge = "reasoning"
    out: list[int] = []
    for i, m in enumerate(messages):
        content = _chars(m["content"])
        last = i == len(messages) - 1
        if merge == "drops" and m["role"] == "assistant" and not last:
            out += [START, ASSISTANT]
        elif merge == "reasoning" and m["role"] == "assistant":
            reasoning, _, answer = m["content"].rpartition("|")
            body = [THINK, *_chars(reasoning), END_THINK] if last and not generation_prompt else []
            out += [START, ASSISTANT, *body, *_chars(answer)]
        elif merge == "start" and m["role"] == "assistant" and m["content"].startswith("S"):
            out += [START, 500 + content[0]] + content[1:]
        elif merge == "end" and m["role"] == "assistant" and m["content"].endswith("1"):
            out += [START, ASSISTANT, *content[:-1], 600]
        else:
            out += [START, ROLES[m["role"]], *content]
        out += [END, NL]
    if merge == "changed" and not generation_prompt and messages[-1]["role"] == "assistant":
        out.append(77)  # the last reply rendered otherwise than where more follows it
    opens = [START, ASSISTANT, THINK] if merge == "reasoning" else [START, ASSISTANT]
    return out + (opens if generation_prompt else [])


class _TemplateServer:
    def __init__(self, merge: str | None = None) -> None:
        self.merge = merge
        self.renders: list[tuple[int, bool]] = []  # (messages, generation prompt) of each /tokenize of messages
        self.texts: list[str] = []  # each /tokenize of plain text
        self.fail_next = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            if self.fail_next:
                self.fail_next -= 1
                return httpx.Response(503, json={"error": {"message": "busy"}})
            if "messages" in body:
                self.renders.append((len(body["messages"]), body["add_generation_prompt"]))
                pairs = zip(body["messages"], body["messages"][1:], strict=False)
                after = [prev for prev, m in pairs if m["role"] == "tool"]
                if self.merge == "tool_calls" and any(not prev.get("tool_calls") for prev in after):
                    # A template that ties a tool message to the call before it (as gpt-oss's does).
                    return httpx.Response(400, json={"error": {"message": "tool message without a tool call"}})
                ids = _render(body["messages"], body["add_generation_prompt"], self.merge)
            else:
                self.texts.append(body["prompt"])
                ids = _chars(body["prompt"])
            answer = {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}  # vLLM's
            return httpx.Response(200, content=json.dumps(answer, separators=(",", ":")).encode())
        assert request.url.path == "/v1/completions", request.url
        assert body["return_tokens_as_token_ids"] is True and "return_token_ids" not in body
        return httpx.Response(
            200,
            json={"choices": [{"index": 0, "text": "x", "finish_reason": "length",
                               "logprobs": {"tokens": ["token_id:1120"], "token_logprobs": [-0.5]}}],
                  "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}},
        )  # fmt: skip


def _reply_turn(index: int, text: str, ids: list[int]):  # type: ignore[no-untyped-def]
    from rollout_service.protocol import Turn

    return Turn.model_construct(
        index=index, completion=text, completion_token_ids=ids, logprobs=[-0.5] * len(ids), trainable=True,
        policy_version=None, policy_version_end=None, finish_reason="stop" if ids and ids[-1] == END else "length",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("sampled", "merge", "how", "renders_per_turn", "texts_per_turn"),
    [
        ("as_tokenized", None, "from_samples", 1, 0),  # the reply's ids are the template's
        ("two_per_token", None, "from_reply", 1, 1),  # sampled otherwise; the reply alone tokenizes as in place
        ("two_per_token", "end", "rendered_apart", 2, 1),  # in place it tokenizes otherwise again
        ("as_tokenized", "start", "rendered_apart", 2, 0),  # ... and so does the prompt before it: not asked
    ],
)
def test_a_turn_finds_the_envs_new_tokens_the_cheapest_way_the_render_confirms(
    sampled, merge, how, renders_per_turn, texts_per_turn
):
    """Three attempts of one group open on the same messages (one render for all three), sample a reply,
    go on with the env's next message, sample a second reply (as the tokenizer splits it) and go on
    again. Each prompt must be the one before, the ids sampled, the end of turn and the template's
    render of the new message, whichever way the split was found: after the sampled ids; after the
    reply's text tokenized alone; or by rendering the conversation so far. The third turn goes on
    after the sampled ids whatever the first reply was: it is read on from the template's own render
    of the conversation, not from the ids sampled. Breaks tried: the opening not shared (3 renders,
    fails); the bridge left out of the from_samples return (ids wrong, fails); the reply compared at
    the wrong offset (rendered apart, counts fail); read on from the segment's sampled ids instead of
    the last render (the third turn rendered apart after a first reply sampled otherwise, fails)."""
    import asyncio

    from rollout_service.backends.replica_pool import ReplicaPool
    from rollout_service.backends.template_renderer import TemplateRenderer
    from rollout_service.server.groups.trajectory import TrajectoryBuilder

    server = _TemplateServer(merge)
    opening = [{"role": "user", "content": "task"}]
    reply, second_reply = "SELECT 1", "done"
    # Sampled ids that decode to the reply: the template's own split, or another split (a pair of
    # characters as one id, as a constrained or unlucky sample may take).
    ids = _chars(reply) if sampled == "as_tokenized" else [9000 + i for i in range(len(reply) // 2)]
    observation, second_observation = {"role": "user", "content": "1 row"}, {"role": "user", "content": "ok"}
    conversation = [*opening, {"role": "assistant", "content": reply}, observation]
    longer = [*conversation, {"role": "assistant", "content": second_reply}, second_observation]

    async def go() -> tuple[list[list[list[int]]], list[list[str | None]]]:
        client = ReplicaPool(["http://model"], http=stand_in(httpx.MockTransport(server.handle)))
        try:
            renderer = TemplateRenderer(client, "m")
            assert await renderer.supported("g")
            builders = [TrajectoryBuilder(renderer, "g") for _ in range(3)]
            server.renders.clear()
            server.texts.clear()

            def sent(prompt: list[int]) -> list[int]:
                # What is sent is the list's own JSON, kept as it grew (transport.JsonList); the list is
                # the trajectory's, which the turn's record grows: copied as it was when sent.
                assert dumps(prompt) == orjson.dumps(list(prompt))
                return list(prompt)

            prompts = [[sent(p) for p in await asyncio.gather(*(b.prompt(opening) for b in builders))]]
            assert len(server.renders) == 1, server.renders  # one opening render for the group
            for b in builders:
                b.record(_reply_turn(0, reply, ids))
            prompts.append([sent(await b.prompt(conversation)) for b in builders])
            continued = [[b.continued for b in builders]]
            for b in builders:
                b.record(_reply_turn(1, second_reply, _chars(second_reply)))
            prompts.append([sent(await b.prompt(longer)) for b in builders])
            continued.append([b.continued for b in builders])
            written = [arr for b in builders for s in b.segments for arr in (s.token_ids, s.loss_mask, s.logprobs)]
            assert all(dumps(arr) == orjson.dumps(list(arr)) for arr in written)
            return prompts, continued
        finally:
            await client.aclose()

    prompts, continued = asyncio.run(go())
    opened = _render(opening, True, merge)
    second = opened + ids + [END, NL] + _render([observation], True, merge)
    third = second + _chars(second_reply) + [END, NL] + _render([second_observation], True, merge)
    assert prompts == [[opened] * 3, [second] * 3, [third] * 3]
    assert continued == [[how] * 3, ["from_samples"] * 3]
    assert len(server.renders) == 1 + 3 * renders_per_turn + 3
    assert server.texts == [reply] * (3 * texts_per_turn)


def _three_turns(merge: str, replies: list[str], end_sampled: bool) -> tuple[list, list, list, _TemplateServer]:
    """Three prompts of one builder on the stand-in template `merge` (the model sampled `replies`, each
    token a character, with the end-of-turn token after each where `end_sampled`): the prompts, how each
    went on, the segments, and the stand-in (its renders)."""
    import asyncio

    from rollout_service.backends.replica_pool import ReplicaPool
    from rollout_service.backends.template_renderer import TemplateRenderer
    from rollout_service.server.groups.trajectory import TrajectoryBuilder

    server = _TemplateServer(merge)
    conversation: list[dict] = [{"role": "user", "content": "task"}]

    async def go() -> tuple[list, list, list]:
        client = ReplicaPool(["http://model"], http=stand_in(httpx.MockTransport(server.handle)))
        try:
            renderer = TemplateRenderer(client, "m")
            assert await renderer.supported("g"), renderer.unsupported
            builder = TrajectoryBuilder(renderer, "g")
            prompts, how = [list(await builder.prompt(conversation))], [builder.continued]
            for i, reply in enumerate(replies):
                builder.record(_reply_turn(i, reply, _chars(reply) + ([END] if end_sampled else [])))
                conversation.extend([{"role": "assistant", "content": reply}, {"role": "user", "content": f"ok{i}"}])
                prompts.append(list(await builder.prompt(conversation)))
                how.append(builder.continued)
            return prompts, how, builder.segments
        finally:
            await client.aclose()

    prompts, how, segments = asyncio.run(go())
    return prompts, how, segments, server


@pytest.mark.parametrize("end_sampled", [True, False])
def test_a_reasoning_template_keeps_the_sampled_tokens_and_appends_the_new_part(end_sampled):
    """A template that drops earlier reasoning from history and opens a reasoning block in the generation
    prompt: a fresh render is not what the model saw. Each prompt is the previous one, the completion as
    sampled (reasoning included), the end of turn where the model did not sample it, then the template's
    render of the env's new message and the generation prompt; one segment, marked appended. The oracle
    is the stand-in template itself, asked for the new message alone. Breaks tried: the end-of-turn token
    kept where the model sampled it -> END twice, fails; `prompts` left "rendered" -> fails."""
    replies = ["think|a1", "more|a2"]
    prompts, how, segments, server = _three_turns("reasoning", replies, end_sampled)
    expected = _render([{"role": "user", "content": "task"}], True, "reasoning")
    assert prompts[0] == expected
    for i, reply in enumerate(replies):
        new = _render([{"role": "user", "content": f"ok{i}"}], True, "reasoning")
        expected = expected + _chars(reply) + [END, NL] + new  # END: sampled or appended, once either way
        assert prompts[i + 1] == expected, i
        fresh = _render(
            [{"role": "user", "content": "task"}]
            + [m for j, r in enumerate(replies[: i + 1]) for m in ({"role": "assistant", "content": r},
                                                               {"role": "user", "content": f"ok{j}"})],
            True, "reasoning",
        )  # fmt: skip
        assert prompts[i + 1] != fresh  # what re-rendering would have sent instead
    assert how == [None, "appended", "appended"]
    assert len(segments) == 1 and segments[0].prompts == "appended" and segments[0].cut is None
    # No render of the whole conversation once appending: the opening, the probe's four, one per turn.
    assert all(n <= 4 for n, _ in server.renders[4:]), server.renders


def test_a_template_that_renders_the_conversation_so_far_otherwise_goes_on_appended():
    """The third way sees a template render the conversation so far otherwise once more follows it: the
    segment keeps its tokens and appends the new part from then on, marked appended. Break tried: the
    fallback to `_appended` removed -> a template_changed cut, fails."""
    prompts, how, segments, _ = _three_turns("changed", ["hi", "yo"], end_sampled=False)
    opened = _render([{"role": "user", "content": "task"}], True)
    second = opened + _chars("hi") + [END, NL] + _render([{"role": "user", "content": "ok0"}], True)
    assert prompts[1] == second
    assert prompts[2] == second + _chars("yo") + [END, NL] + _render([{"role": "user", "content": "ok1"}], True)
    assert how == [None, "appended", "appended"]
    assert [(s.cut, s.prompts) for s in segments] == [(None, "appended")]


def test_a_template_whose_new_part_cannot_be_read_cuts_and_is_no_continuation():
    """A template that drops an earlier reply's content renders neither the whole conversation nor the
    new messages after a known reply: the turn begins a segment, cut as template_changed, and is not
    counted as a turn that went on. Break tried: `continued` set before the cut -> fails."""
    prompts, how, segments, _ = _three_turns("drops", ["hi"], end_sampled=False)
    conversation = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "hi"}]
    assert prompts[1] == _render([*conversation, {"role": "user", "content": "ok0"}], True, "drops")
    assert how == [None, None]
    assert [(s.cut, s.prompts) for s in segments] == [(None, "rendered"), ("template_changed", "rendered")]


@pytest.mark.parametrize(
    ("merge", "new"),
    [
        # R1 hoists a system message to the very start; its text holds a "b" of its own.
        ("hoisting", [{"role": "system", "content": "Pick b) or c)"}, {"role": "user", "content": "next"}]),
        # The template refuses a tool message after a reply that made no tool call (400).
        ("tool_calls", [{"role": "tool", "content": "b rows"}]),
    ],
)
def test_new_messages_a_template_renders_elsewhere_or_refuses_cut_the_segment(merge, new):
    """Where the new messages are not rendered after the reply (moved before it) or the template refuses
    them after the probe's reply, nothing is appended: the turn opens a new segment, rendered fresh,
    cut as template_changed. Breaks tried: new_part's head check dropped -> the probe's own
    conversation is appended after the "b" in the system text; the refusal not caught -> the turn
    raises InferenceRejected (the attempt fails)."""
    import asyncio

    from rollout_service.backends.replica_pool import ReplicaPool
    from rollout_service.backends.template_renderer import TemplateRenderer
    from rollout_service.server.groups.trajectory import TrajectoryBuilder

    server = _TemplateServer(merge)
    opening = [{"role": "user", "content": "task"}]

    async def go() -> tuple[TrajectoryBuilder, list[int]]:
        client = ReplicaPool(["http://model"], http=stand_in(httpx.MockTransport(server.handle)))
        try:
            renderer = TemplateRenderer(client, "m")
            assert await renderer.supported("g"), renderer.unsupported
            builder = TrajectoryBuilder(renderer, "g")
            await builder.prompt(opening)
            builder.record(_reply_turn(0, "hi", _chars("hi") + [END]))
            conversation = [*opening, {"role": "assistant", "content": "hi", "tool_calls": [{"id": "1"}]}, *new]
            return builder, list(await builder.prompt(conversation))
        finally:
            await client.aclose()

    builder, ids = asyncio.run(go())
    assert [s.cut for s in builder.segments] == [None, "template_changed"]
    assert builder.continued is None
    conversation = [*opening, {"role": "assistant", "content": "hi", "tool_calls": [{"id": "1"}]}, *new]
    assert ids == _render(conversation, True, merge)  # the new segment: the template's own render


def test_a_failed_opening_render_fails_only_the_attempt_that_asked():
    """A group's shared opening render that failed is not handed to the attempts that joined it (each
    asks once itself) nor kept for the next attempt. Breaks tried: the joiners given the failure -> 3
    of 4 fail; the failed render left in place -> the next attempt fails."""
    import asyncio

    from rollout_service.backends.errors import InferenceError
    from rollout_service.backends.replica_pool import ReplicaPool
    from rollout_service.backends.template_renderer import TemplateRenderer
    from rollout_service.server.groups.trajectory import TrajectoryBuilder

    server = _TemplateServer()
    opening = [{"role": "user", "content": "task"}]

    async def go() -> tuple[list, list[int]]:
        client = ReplicaPool(["http://model"], http=stand_in(httpx.MockTransport(server.handle)))
        try:
            renderer = TemplateRenderer(client, "m")
            assert await renderer.supported("g")
            server.fail_next = 1
            first = await asyncio.gather(
                *(TrajectoryBuilder(renderer, "g").prompt(opening) for _ in range(4)), return_exceptions=True
            )
            return first, await TrajectoryBuilder(renderer, "g").prompt(opening)
        finally:
            await client.aclose()

    first, later = asyncio.run(go())
    opened = _render(opening, True)
    assert [isinstance(r, InferenceError) for r in first] == [True, False, False, False]
    assert first[1:] == [opened] * 3 and later == opened


def test_the_ids_after_known_ones_are_read_from_the_answers_bytes_only_where_they_are_sure():
    """TokenizeAnswer.after: the ids after a known render's, or None wherever the bytes cannot say so for
    sure (then the whole answer is read). Oracle: the standard library's JSON of the same answers.
    Breaks tried: the count not compared -> the disagreeing count passes, fails; the prefix without
    its trailing comma -> [1,2,3] matches [1,2,30,...], fails."""
    from rollout_service.backends.answers import TokenizeAnswer

    def vllm(ids: list[int], count: int | None = None, **dump: object) -> TokenizeAnswer:
        answer = {"count": len(ids) if count is None else count, "max_model_len": 8, "tokens": ids, "token_strs": None}
        return TokenizeAnswer(json.dumps(answer, **dump).encode())  # type: ignore[arg-type]

    def known(ids: list[int]) -> bytes:
        return json.dumps(ids, separators=(",", ":")).encode()

    ids = [1, 2, 30, 4, 5]
    compact = {"separators": (",", ":")}
    assert vllm(ids, **compact).array == known(ids)
    assert vllm(ids, **compact).after(known([1, 2, 30])) == [4, 5]
    assert vllm(ids, **compact).after(known([1, 2])) == [30, 4, 5]
    for prefix in ([1, 2, 3], [2, 30], ids, [], [*ids, 6]):  # not a prefix, all of them, or none
        assert vllm(ids, **compact).after(known(prefix)) is None, prefix
    assert vllm(ids).after(known([1, 2])) is None  # spaced JSON: not sure, so not read this way
    assert vllm(ids).ids() == ids
    assert vllm(ids, count=6, **compact).after(known([1, 2])) is None  # the server's count disagrees
    for body in (
        b'{"count":3,"tokens":[1,2,"x"]}',
        b'{"count":3,"tokens":[1,2,3.5]}',
        b'{"count":3,"tokens":[1,2,345',  # cut short
        b'{"count":3,"tokens":[1,2,]}',  # not JSON
        b'{"count":3,"tokens":[1,2,3],"tokens":[1,2,9]}',  # which one a decoder keeps is its choice
        b'{"count":3,"x":{"tokens":[1,2,3]}}',
        b'[{"count":3,"tokens":[1,2,3]}]',
        b'{"count":3,"tokens":[1,2,3]}garbage',
        b'{"tokens":[1,2,3]}',  # no count: not vLLM's shape
        b'{"count":3,"tokens":[1,2, ]}',
        b'{"tokens":[1,2,3,4],"tokens":0,"count":4}',  # the top-level "tokens" is no list
        b'{"x":{"tokens":[1,2,3,4]},"tokens":false,"count":4}',
        b'{"a\\"tokens":[1,2,3,4],"count":4,"tokens":0}',
    ):
        assert TokenizeAnswer(body).after(known([1, 2])) is None, body


def test_a_reply_alone_is_not_tokenized_while_that_seldom_helps():
    """The second way costs a request: after it failed ten turns running it is asked once in 16 turns,
    and once it holds again (a template or model that changed) it is asked every turn. Break tried:
    always worth asking -> 32 asks of 32, fails."""
    from rollout_service.backends.template_renderer import _Odds

    odds = _Odds()
    for _ in range(10):
        assert odds.worth_asking()
        odds.saw(False)
    assert sum(odds.worth_asking() for _ in range(32)) == 2
    for _ in range(3):
        odds.saw(True)
    assert all(odds.worth_asking() for _ in range(32))
