"""The model servers a deployment starts are keyed (vLLM's --api-key, read from $VLLM_API_KEY), and the
service sends the key: here with `rollout-service up`'s local stack, on a vLLM of its own (the session's
shared one is unkeyed). The Ray deployment's replica is checked in tests/test_cluster.py, compose's in
docker/e2e.sh.

Breaks tried: LocalStack.start_service without `--vllm-api-key-env` -> the service cannot list the
model at start (401) and the stack does not come up, fails; launch_embedded_vllm ignoring `api_key` ->
the completion without a key answers 200, fails; ReplicaRegistry._replica_key returning None -> the
unset variable is not refused, and the replica named with a wrong key's variable is sent the route's
(right) key and added, fails.
"""

from __future__ import annotations

import os
import stat
import sys

import httpx
import pytest

from rollout_service.launch import embedded_model
from rollout_service.launch.stack import LocalStack, service_command, start_listening
from rollout_service.protocol import GroupResult
from rollout_service.trainer import RolloutClient
from rollout_service.trainer.client import RequestRejected, RolloutError

SAMPLING = {"temperature": 0.8, "max_tokens": 24}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("keyed-stack")
    with LocalStack(log_dir=logs, pool=2, say=lambda line: print(line, file=sys.stderr)) as running:
        yield running


def test_the_local_stacks_vllm_answers_only_its_key_and_groups_score(stack):
    vllm = stack.urls["vllm"]
    key_file = stack.log_dir / "vllm.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text().strip() == stack.vllm_api_key
    completion = {"model": embedded_model.MODEL_NAME, "prompt": "Hello", "max_tokens": 1}
    assert httpx.post(f"{vllm}/v1/completions", json=completion, timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.get(f"{vllm}/v1/models", headers=wrong, timeout=10).status_code == 401
    right = {"Authorization": f"Bearer {stack.vllm_api_key}"}
    assert httpx.get(f"{vllm}/v1/models", headers=right, timeout=10).status_code == 200
    # Its key is not on its command line, where `ps` would show it.
    vllm_proc = stack.process("vllm")
    assert stack.vllm_api_key not in " ".join(vllm_proc.cmd)
    with RolloutClient(stack.urls["service"], timeout_s=300) as client:
        group = client.group(task_id="t001", n=2, sampling=SAMPLING)
    assert isinstance(group, GroupResult)
    assert group.counts.scored == 2, [(a.status, a.failure) for a in group.attempts]


def test_a_replica_added_by_url_is_sent_the_key_its_variable_names(stack, tmp_path):
    """A second service (started on the stack's vLLM with the key in VLLM_KEY_A) is given the same vLLM
    under another URL with `api_key_env: VLLM_KEY_B`: it is added and serves a group once the first URL is
    removed; named with a variable holding a wrong key, it is not added (it answers that key 401). A variable
    that is unset, not listed in --replica-key-envs, or that holds the service's own key, is refused with 422.
    Break tried: the --replica-key-envs check skipped -> `HOME` is read and sent, no 422, fails."""
    port = stack.urls["vllm"].rsplit(":", 1)[1]
    env = {
        **os.environ,
        "VLLM_KEY_A": stack.vllm_api_key or "",
        "VLLM_KEY_B": stack.vllm_api_key or "",
        "VLLM_KEY_WRONG": "not-the-key-of-this-vllm",
        "ADMIN_KEY": "an-admin-key-for-this-test",
    }
    cmd = service_command(
        0,
        [stack.urls["env"]],
        f"http://127.0.0.1:{port}",
        "--vllm-api-key-env",
        "VLLM_KEY_A",
        "--admin-key-env",
        "ADMIN_KEY",
        "--api-key-env",
        "ADMIN_KEY",
        "--replica-key-envs",
        "VLLM_KEY_B",
        "--replica-key-envs",
        "VLLM_KEY_WRONG",
        "--replica-key-envs",
        "VLLM_KEY_UNSET",
        "--replica-key-envs",
        "ADMIN_KEY",
    )
    started: list = []
    try:
        service = start_listening("service-b", cmd, tmp_path, started, env=env, timeout_s=120)
        with RolloutClient(service.url, api_key="an-admin-key-for-this-test", timeout_s=300) as client:
            with pytest.raises(RequestRejected) as unset:
                client.add_replica(f"http://localhost:{port}", api_key_env="VLLM_KEY_UNSET", timeout_s=30)
            assert unset.value.status == 422 and unset.value.error == "replica_key_missing"
            with pytest.raises(RequestRejected) as unlisted:  # any other variable of the service's
                client.add_replica(f"http://localhost:{port}", api_key_env="HOME", timeout_s=30)
            assert unlisted.value.status == 422 and unlisted.value.error == "replica_key_not_allowed"
            with pytest.raises(RequestRejected) as own:
                client.add_replica(f"http://localhost:{port}", api_key_env="ADMIN_KEY", timeout_s=30)
            assert own.value.status == 422 and own.value.error == "replica_key_refused"
            with pytest.raises(RolloutError):
                client.add_replica(f"http://localhost:{port}", api_key_env="VLLM_KEY_WRONG", timeout_s=10)
            added = client.add_replica(f"http://localhost:{port}", api_key_env="VLLM_KEY_B", timeout_s=120)
            assert added.routed, added
            client.remove_replica(f"http://127.0.0.1:{port}", timeout_s=60)
            group = client.group(task_id="t002", n=2, sampling=SAMPLING)
            assert group.counts.scored == 2, [(a.status, a.failure) for a in group.attempts]
            assert {t.endpoint for a in group.attempts for t in a.turns} == {f"http://localhost:{port}"}
    finally:
        for proc in started:
            proc.stop()
