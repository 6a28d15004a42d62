"""An env's step answers decoded by msgspec (backends/env_client.py's StepAnswer) accept and refuse
what the pydantic model they replaced did, and read the same values.

The oracle is that pydantic model, written out here as it was (no code under test in it). The
answers are bytes handed to the decoder directly: refenv cannot be made to send most of them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_service.backends.env_client import BadEnvAnswer, _step_answer
from rollout_service.backends.transport import HttpAnswer


class _Observation(BaseModel):
    model_config = ConfigDict(extra="allow")
    stage: str = "unknown"
    messages: list[dict[str, Any]] = Field(default_factory=list)
    functions: Any = None
    response_format: Any = None


class _StepAnswer(BaseModel):
    model_config = ConfigDict(extra="allow")
    episode_id: str
    task_id: str | None = None
    slug: str | None = None
    done: bool = False
    observation: _Observation | None = None
    status: str | None = None
    answer: Any = None
    pass_: bool = Field(False, alias="pass")
    reward: float = Field(0.0, allow_inf_nan=False)
    score: dict[str, Any] | None = None


ANSWERS = [
    b'{"episode_id": "e1", "observation": {"stage": "sql", "messages": [{"role": "user", "content": "hi"}]}}',
    b'{"episode_id": "e1", "done": true, "status": "completed", "pass": true, "reward": 1, "score": {"a": 1}}',
    b'{"episode_id": "e1", "done": true, "answer": [1, {"x": null}], "reward": -0.5, "extra": {"kept": 0}}',
    b'{"episode_id": "e1", "done": "true", "reward": "1.5"}',  # pydantic's lax mode: strings of a bool, a number
    b'{"episode_id": "e1", "done": 1, "pass": 0}',
    b'{"episode_id": "e1", "observation": {"stage": "s", "response_format": {"type": "json_object"}, "x": 1}}',
    b'{"episode_id": "e1", "observation": null}',
    b'{"episode_id": "e1", "task_id": "t1", "slug": "s"}',
    b'{"episode_id": 5}',
    b'{"episode_id": "e1", "done": "maybe"}',
    b'{"episode_id": "e1", "reward": "nan"}',
    b'{"episode_id": "e1", "reward": "inf"}',
    b'{"episode_id": "e1", "observation": {"stage": 3}}',
    b'{"episode_id": "e1", "observation": {"messages": ["not an object"]}}',
    b'{"episode_id": "e1", "score": [1]}',
    b'{"done": true}',
    b'{"episode_id": "e1", "pass": "yes please"}',
]


@pytest.mark.parametrize("body", ANSWERS)
def test_a_step_answer_is_read_as_the_pydantic_model_read_it(body):
    """Breaks tried: the decoder made strict (msgspec's default) -> the "true"/"1.5" and 1/0 answers
    are refused where pydantic took them; the finite-reward check removed -> "nan" and "inf" pass."""
    try:
        expected = _StepAnswer.model_validate_json(body)
    except ValidationError:
        expected = None
    try:
        got = _step_answer(HttpAnswer(200, body), "POST /step")
    except BadEnvAnswer as exc:
        assert expected is None, f"refused what pydantic read: {exc}"
        assert exc.kind == "env_bad_answer" and exc.message.startswith("StepAnswer: ")
        return
    assert expected is not None, f"read what pydantic refused: {got}"
    for name in ("episode_id", "task_id", "slug", "done", "status", "answer", "pass_", "reward", "score"):
        assert getattr(got, name) == getattr(expected, name), name
        assert type(getattr(got, name)) is type(getattr(expected, name)), name
    if expected.observation is None:
        assert got.observation is None
    else:
        assert got.observation is not None
        for name in ("stage", "messages", "functions", "response_format"):
            assert getattr(got.observation, name) == getattr(expected.observation, name), name
