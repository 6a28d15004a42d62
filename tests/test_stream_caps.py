"""Sampler streams are bounded: how many exist (in all and per key), what they buffer together, and how
long one nobody pulls may live. A real service and refenv; a slow scripted model, so streams are open
and generating (not finished) while the caps are tried."""

from __future__ import annotations

import httpx

KEYS = {"TEST_DATA_KEY": "trainer-key", "TEST_ADMIN_KEY": "operator-key"}
TRAINER, OPERATOR = {"Authorization": "Bearer trainer-key"}, {"Authorization": "Bearer operator-key"}


def _open(service: str, key: dict[str, str], buffer: int = 2, idle: float = 30) -> httpx.Response:
    body = {"buffer": buffer, "idle_timeout_s": idle, "group": {"n": 2, "sampling": {"max_tokens": 8}}}
    return httpx.post(f"{service}/samplers", json=body, headers=key, timeout=30)


def test_streams_are_capped_in_all_per_key_and_by_what_they_buffer(start_refenv, start_service, start_scripted_model):
    """Break tried: `_check_caps` skipped (no caps, as before) -> the trainer's third stream is 201."""
    model = start_scripted_model("sql-forever", "--delay", "0.5")
    env = start_refenv("--pool", "4")
    service = start_service(
        [env.url], "--api-key-env", "TEST_DATA_KEY", "--admin-key-env", "TEST_ADMIN_KEY",
        "--max-sampler-streams", "3", "--max-sampler-streams-per-key", "2", "--max-sampler-buffer", "10",
        env=KEYS, vllm=model.url, model="scripted",
    ).url  # fmt: skip
    mine = [_open(service, TRAINER) for _ in range(2)]
    assert [r.status_code for r in mine] == [201, 201], [r.text for r in mine]

    # Per key: the trainers' third is refused, saying which cap, which flag, and when to retry.
    third = _open(service, TRAINER)
    assert third.status_code == 429 and third.json()["error"] == "too_many_streams_for_key", third.text
    assert "--max-sampler-streams-per-key" in third.json()["message"]
    # Retry-After: when the soonest of the trainer's streams would expire unpulled, by their own state.
    soonest = min(
        s["idle_timeout_s"] - s["idle_s"]
        for s in (httpx.get(f"{service}/samplers/{r.json()['id']}", headers=TRAINER).json() for r in mine)
    )
    assert 1 <= int(third.headers["Retry-After"]) <= soonest + 1, (third.headers, soonest)

    # Another key still has room; then the service as a whole is full.
    assert _open(service, OPERATOR).status_code == 201
    full = _open(service, OPERATOR)
    assert full.status_code == 429 and full.json()["error"] == "too_many_streams", full.text
    assert "--max-sampler-streams" in full.json()["message"] and "Retry-After" in full.headers

    # What the streams buffer together: 3 x 2 open; one deleted frees 2 of the 10.
    assert httpx.delete(f"{service}/samplers/{mine[0].json()['id']}", headers=TRAINER, timeout=60).status_code == 200
    big = _open(service, TRAINER, buffer=7)
    assert big.status_code == 429 and big.json()["error"] == "sampler_buffer_full", big.text
    assert "--max-sampler-buffer" in big.json()["message"] and "4 groups" in big.json()["message"]
    assert _open(service, TRAINER, buffer=6).status_code == 201

    # A buffer no wait could make room for is a 422, not a 429 to retry for ever.
    never = _open(service, TRAINER, buffer=11)
    assert never.status_code == 422 and never.json()["error"] == "buffer_over_cap", never.text
    # A stream nobody pulls lives an hour at most.
    long = _open(service, OPERATOR, idle=3601)
    assert long.status_code == 422 and "idle_timeout_s" in long.json()["message"], long.text

    # Meanwhile another trainer's group runs.
    group = httpx.post(
        f"{service}/groups",
        json={"task_id": "t001", "n": 2, "max_turns": 1, "sampling": {"max_tokens": 8}},
        headers=TRAINER,
        timeout=120,
    )
    assert group.status_code == 200 and group.json()["counts"]["scheduled"] == 2, group.text
