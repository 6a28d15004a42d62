"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import math
import random
import socket
import statistics
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import httpx

from rollout_service.launch import embedded_model
from rollout_service.launch.stack import port_in_use


def wait_until(predicate, timeout_s: float = 5.0, every_s: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout_s` passes; HTTP errors count as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    try:
        return bool(predicate())
    except httpx.HTTPError:
        return False


def cli(
    *args: str, timeout: float = 600, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`rollout-service ARGS...` in a child process, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "rollout_service.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def assert_accounted(group: dict) -> None:
    """Every scheduled attempt is scored with a reward, or failed with a reason and no reward."""
    c = group["counts"]
    assert c["scheduled"] == group["n"] == c["scored"] + c["failed"] == len(group["attempts"])
    by_status: dict[str, int] = {}
    for attempt in group["attempts"]:
        by_status[attempt["status"]] = by_status.get(attempt["status"], 0) + 1
        if attempt["status"] == "scored":
            assert attempt["reward"] is not None and attempt["failure"] is None
        elif attempt["status"] == "policy_failure":  # the README: it earns policy_failure_reward, flagged
            assert attempt["failure"]["attribution"] == "policy", attempt
            assert attempt["reward"] == group["policy_failure_reward"], attempt
        else:
            assert attempt["reward"] is None and attempt["advantage"] is None, attempt
            assert attempt["failure"]["kind"] and attempt["failure"]["attribution"] == "infrastructure", attempt
    # The counts against the attempts themselves, not against each other.
    assert c["by_status"] == by_status
    assert c["scored"] == by_status.get("scored", 0)
    assert c["policy_failed"] == by_status.get("policy_failure", 0)
    assert c["rewarded"] == sum(a["reward"] is not None for a in group["attempts"])


def assert_env_accounted(health: dict) -> None:
    """refenv's own counters add up: every episode it started has ended one way or is still live
    (refenv/episodes.py `Counters`: started == finished + abandoned + reclaimed + failed + timed_out
    + live episodes, once each ended episode's world is back in the pool)."""
    e = health["episodes"]
    ended = e["finished"] + e["abandoned"] + e["reclaimed"] + e["failed"] + e["timed_out"]
    assert e["started"] == ended + health["live_episodes"], (
        f"env episodes do not add up: started {e['started']} != ended {ended} "
        f"({', '.join(f'{k} {v}' for k, v in e.items() if k != 'started')}) + live {health['live_episodes']}"
    )


def prompt_ids(attempt: dict, turn: int = 0) -> list[int]:
    """The ids turn `turn` of `attempt` was generated from, read as the README says: the turn's own
    `prompt_token_ids` in chat mode; in exact mode (where they are null) its segment up to its span."""
    record = attempt["turns"][turn]
    if record["prompt_token_ids"] is not None:
        return record["prompt_token_ids"]
    segment = attempt["trajectory"][record["segment"]]
    [span] = [s for s in segment["turns"] if s["turn"] == record["index"]]
    return segment["token_ids"][: span["start"]]


def unclaimed_ports(count: int = 1) -> int:
    """A base port with `count` free ports from it, for a piece that must listen on a port known before it
    starts (a service started before its env, a process restarted on its port). A piece of ours started
    now binds port 0 itself and reports the port it got (`launch` with port None: --port-file), which no
    other process can take. These are below Linux's ephemeral range (32768-60999), where the kernel picks
    for every bind(0) and outgoing connection: a port found free there may be handed to another process
    before the piece binds it (a service once found another test's model server where its env was to
    start, and failed)."""
    for _ in range(200):
        base = random.randrange(20000, 30000 - count + 1)  # Ray's workers take 30000 and up (test_cluster)
        if not any(port_in_use(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


def _results() -> list[object]:
    import gc

    from rollout_service.protocol import Attempt, GroupResult, Turn

    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), Attempt | Turn | GroupResult)]


def results_held() -> list[object]:
    """The result objects alive before a retention check starts: an earlier test in this worker may
    have left some (TRL keeps its trainer, and what it saw, reachable). The caller holds this list
    for the check, so no id in it can be reused by one of the check's own objects."""
    return _results()


def results_alive(held: list[object] | None = None) -> list[str]:
    """The type names of the Attempt, Turn and GroupResult objects this process still holds after a
    collection, less those `held` from before the check: the garbage collector's own list, the oracle
    for "nothing keeps a finished group". By type: isinstance asks each object its __class__, and
    some run code when asked (torch's deprecated reduce_op warns)."""
    before = {id(o) for o in held or ()}
    return [type(o).__name__ for o in _results() if id(o) not in before]


@cache
def _base_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(embedded_model.cache_dir()), dtype=torch.float32).eval()


def base_token_logprobs(ids: list[int]) -> list[float]:
    """The embedded model's own logprob of each token after the ones before it (`ids[1:]`), recomputed
    in float32 by transformers: an oracle for logprobs independent of vLLM."""
    import torch

    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = _base_model()(tokens).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0].tolist()


def assert_logprobs_are_the_policys(attempts: list[dict]) -> None:
    """The unconstrained logprobs of `attempts`' segments are the policy's own: recomputed in float32
    from the segment's ids, they agree to bf16 noise, with no offset. bf16 noise on this model is ~0.04
    nats mean on a quiet server and up to ~0.06 while other tests' requests share its batches; the same
    logprobs read one position off are ~2 nats away, so the bounds tell the policy's own logprobs from
    misaligned or other weights' ones."""
    deltas: list[float] = []
    shifted: list[float] = []  # the same logprobs against the next position's: what misalignment gives
    for attempt in attempts:
        for segment in attempt["trajectory"]:
            own = base_token_logprobs(segment["token_ids"])
            for position, (mask, lp) in enumerate(zip(segment["loss_mask"], segment["logprobs"], strict=True)):
                if mask:
                    deltas.append(lp - own[position - 1])
                    if position < len(own):
                        shifted.append(abs(lp - own[position]))
    assert len(deltas) >= 30, len(deltas)
    absolute = [abs(d) for d in deltas]
    print("agreement:", len(deltas), "tokens; mean |d|", statistics.mean(absolute), "max", max(absolute))
    print("signed mean", statistics.mean(deltas), "; one position off: mean |d|", statistics.mean(shifted))
    assert statistics.mean(absolute) < 0.1, statistics.mean(absolute)
    assert statistics.median(absolute) < 0.05, statistics.median(absolute)
    assert max(absolute) < 1.0, max(absolute)
    assert abs(statistics.mean(deltas)) < 0.03, statistics.mean(deltas)  # no systematic offset
    assert statistics.mean(shifted) > 10 * statistics.mean(absolute), statistics.mean(shifted)
    assert all(math.isfinite(d) for d in deltas)


def send_unread_batch(service: str, groups: list[dict]) -> socket.socket:
    """A raw socket with a small receive buffer that has sent POST /groups/batch and will read nothing."""
    payload = json.dumps({"groups": groups}).encode()
    host, port = service.removeprefix("http://").split(":")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect((host, int(port)))
    reader.sendall(
        b"POST /groups/batch HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    return reader
