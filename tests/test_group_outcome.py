"""A finished group as Admission hands it on (server/groups/group_json.py's GroupOutcome): the typed
result its readers in the service use and the JSON every reader outside gets, encoded once.

Stand-ins (bench/standins.py's instant model server and env), not vLLM and refenv: the oracle is a
second encoder of the very result the service made, so the group must hold everything a real one does
(exact turns with thousands of prompt ids, logprobs, the trajectory's arrays) and come out the same on
every run; the stand-ins answer deterministically and at once.
"""

from __future__ import annotations

import asyncio
import json
import sys

from rollout_service.protocol import GroupRequest, GroupResult
from rollout_service.server.config import ServiceConfig
from rollout_service.server.groups.group_json import GroupOutcome, one_line
from rollout_service.server.service import RolloutService

MODEL = "ceiling-model"  # the name bench/standins.py's model serves


def _run_groups(env_url: str, model_url: str, requests: list[GroupRequest]) -> list[GroupOutcome]:
    async def run() -> list[GroupOutcome]:
        service = RolloutService(ServiceConfig(env=[env_url], vllm=[model_url], model=MODEL))
        try:
            await service.start(say=lambda _: None)
            return list(await asyncio.gather(*service.admission.start_groups(requests)))
        finally:
            await service.close()

    return asyncio.run(run())


def test_a_groups_json_is_pydantics_encoding_of_the_typed_result_it_comes_with(launch):
    """The body handed on is, byte for byte, what pydantic's own serialiser (model_dump_json by alias,
    the protocol's definition of a group's JSON and independent of group_json's orjson writer) makes of
    the typed result handed on with it: exact and chat groups, each with several turns; and the typed
    result is what a reader outside parses back from the body.
    Breaks tried: group_json writing each field under its attribute name instead of its alias (`pass_`
    for `pass`) -> the body differs from pydantic's; the completion's ids read from vLLM's
    "token_id:<id>" strings (backends/answers.py) shifted by one -> the turn's ids are not the
    stand-in's."""
    py = sys.executable
    model = launch("model", None, [py, "bench/standins.py", "model", "--port", "0", "--completion-tokens", "24"])
    env = launch(
        "env", None, [py, "bench/standins.py", "env", "--port", "0", "--pool", "8", "--turns", "3",
                      "--prompt-tokens", "300"],
    )  # fmt: skip
    requests = [
        GroupRequest(task_id="t1", n=2, tokens="exact", sampling={"max_tokens": 24}),
        GroupRequest(task_id="t1", n=2, tokens="chat", sampling={"max_tokens": 24}),
    ]
    outcomes = _run_groups(env.url, model.url, requests)
    for outcome, request in zip(outcomes, requests, strict=True):
        result = outcome.result
        assert [a.status for a in result.attempts] == ["scored"] * request.n, result.attempts
        assert all(len(a.turns) == 3 for a in result.attempts)
        assert outcome.body == one_line(result.model_dump_json(by_alias=True).encode())
        assert GroupResult.model_validate_json(outcome.body) == result
        group = json.loads(outcome.body)
        assert "pass" in group["attempts"][0] and "pass_" not in group["attempts"][0]
    exact = outcomes[0].result.attempts[0]
    turn = exact.turns[0]
    # The stand-in samples ids 1000, 1001, ... with logprob -0.25 each (bench/standins.py).
    assert turn.completion_token_ids == list(range(1000, 1024)) and turn.logprobs == [-0.25] * 24
    assert exact.trajectory is not None and len(exact.trajectory[0].token_ids) > 300
