"""A group's JSON, byte for byte, against a golden copy written by the service as it was before its hot
path was made cheaper (issue #47: the same request against the same stand-ins gives the same bytes,
apart from ids and times).

Stand-ins (bench/standins.py's instant model server and env), not vLLM and refenv: they answer the same
bytes on every run, which a real model does not. The oracle is a file, tests/golden/groups-standins.ndjson,
that the service at an earlier commit wrote from these very requests (its code, not this checkout's:
regenerate it only from a checkout whose output is known good, with ROLLOUT_WRITE_GOLDEN=1 and that
checkout's `rollout_service` first on the path, as the test's docstring says), with the ids,
addresses and times each run makes anew replaced by placeholders (`_normalised`). It was rewritten once
since, when the agent lane added the attempt's `agent` field (null on a step attempt), and checked to be
the earlier copy's bytes apart from those insertions.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
import sys
from pathlib import Path

import rollout_service
from rollout_service.protocol import GroupRequest
from rollout_service.server.config import ServiceConfig
from rollout_service.server.service import RolloutService

GOLDEN = Path(__file__).parent / "golden" / "groups-standins.ndjson"
STANDINS = Path(__file__).resolve().parents[1] / "bench" / "standins.py"
MODEL = "ceiling-model"  # the name bench/standins.py's model serves

# What differs from run to run: ids made at random or by the env's counter in the order episodes start,
# the stand-ins' ports, and the times measured.
_RUN_TO_RUN = (
    (re.compile(rb'"(group_id|run_id|episode_id)":"[^"]*"'), rb'"\1":"ID"'),
    (re.compile(rb"http://127\.0\.0\.1:\d+"), rb"http://HOST"),
    (re.compile(rb'"(\w+_s)":[-0-9.e]+'), rb'"\1":0'),
)


def _normalised(body: bytes) -> bytes:
    for pattern, placeholder in _RUN_TO_RUN:
        body = pattern.sub(placeholder, body)
    return body


def _bodies(env_url: str, model_url: str, requests: list[GroupRequest]) -> list[bytes]:
    async def run() -> list[bytes]:
        service = RolloutService(ServiceConfig(env=[env_url], vllm=[model_url], model=MODEL))
        try:
            await service.start(say=lambda _: None)
            return [outcome.body for outcome in await asyncio.gather(*service.admission.start_groups(requests))]
        finally:
            await service.close()

    return asyncio.run(run())


def test_the_groups_json_is_byte_for_byte_what_it_was(launch):
    """Exact groups (a 300-token first observation, three 128-token turns: the ids read from vLLM's
    "token_id:<id>" strings, the trajectory's arrays grown turn by turn) and a chat group, each of two
    attempts, are written as the golden copy holds them, apart from ids, addresses and times.
    To regenerate the copy from a checkout known good (say main, at /tmp/before):
    `cd /tmp/before && ROLLOUT_WRITE_GOLDEN=1 python -m pytest THIS_CHECKOUT/tests/test_group_bytes.py -n 0`.
    Breaks tried: a completion's ids read from the "token_id:<id>" strings shifted by one
    (backends/answers.py) -> the turns' ids and the trajectory differ; JsonList.json leaving out the
    last item's JSON (backends/json_body.py) -> the arrays differ; a group's stream line (group_line)
    is not in this test: tests/test_streaming.py reads those."""
    py = sys.executable
    model = launch("model", None, [py, str(STANDINS), "model", "--port", "0", "--completion-tokens", "128"])
    env = launch(
        "env", None, [py, str(STANDINS), "env", "--port", "0", "--pool", "8", "--turns", "3", "--prompt-tokens", "300"]
    )
    requests = [
        GroupRequest(task_id="t1", n=2, tokens="exact", sampling={"max_tokens": 128}),
        GroupRequest(task_id="t1", n=2, tokens="exact", sampling={"max_tokens": 128, "seed": 7}),
        GroupRequest(task_id="t1", n=2, tokens="chat", sampling={"max_tokens": 128}),
    ]
    bodies = b"".join(_normalised(body) + b"\n" for body in _bodies(env.url, model.url, requests))
    if os.environ.get("ROLLOUT_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_bytes(bodies)
        print(f"golden written by {rollout_service.__file__}")
        return
    golden = GOLDEN.read_bytes()
    if bodies != golden:
        # The first difference, in the JSON's own words (a line is a whole group: cut to where it differs).
        ours, theirs = bodies.decode(), golden.decode()
        short = min(len(ours), len(theirs))
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), short)
        diff = difflib.ndiff([theirs[max(0, at - 200) : at + 200]], [ours[max(0, at - 200) : at + 200]])
        raise AssertionError(f"the groups' JSON differs from the golden copy at byte {at}:\n" + "\n".join(diff))
