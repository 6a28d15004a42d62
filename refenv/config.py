"""The settings of `refenv serve` and `refenv teacher`, each defined once (flags and `REFENV_*`
variables are generated from these models), with GraphJin's flag names where GraphJin has the flag."""

from __future__ import annotations

import re
import sqlite3
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from refenv.grading import PROFILES
from refenv.learning import build_learning_suite
from refenv.tasks import Split, Task, build_suite, parse_split
from refenv.world import build_database
from rollout_service.flags import PORT_FILE_HELP, Flag, ListenAddress, PortFile

ENV_PREFIX = "REFENV_"


def parse_duration(text: str) -> float:
    """'300', '300s', '5m', '1h', '750ms', '1m30s' -> seconds (Go-style durations)."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r} (e.g. 300s, 5m, 750ms)")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


class TaskSuite(BaseModel):
    """The settings that decide which tasks are served and what their answers are. `refenv serve` and
    `refenv teacher` share them (the same flags and `REFENV_*` variables), so that a teacher started
    with an env's flags knows that env's tasks."""

    model_config = ConfigDict(extra="forbid")

    suite: Literal["public", "learning"] = Field(
        "public",
        description="task suite: public (the agent tasks), or learning (families of many one-turn instances "
        "answerable from the prompt, split by instance: for seeing a small model learn)",
    )
    seed: int = Field(0, description="data (and, for serve, fault-injection) seed")
    scale: int = Field(1, ge=1, description="data size multiplier")
    split: Annotated[str | None, Flag(metavar="auto:F|FILE")] = Field(
        None,
        description="auto:F (by family, in the learning suite by instance; deterministic) or a JSON file "
        '{"train": [...], "eval": [...]} of task ids, slugs or families',
    )
    side: Literal["train", "eval"] | None = Field(None, description="which side of --split to serve")
    family: Annotated[str | None, Flag(metavar="NAME[,NAME...]")] = Field(
        None, description="serve only the tasks of these families (comma-separated); default: all"
    )

    @model_validator(mode="after")
    def _check_split(self) -> TaskSuite:
        parse_split(self.split)
        return self

    def load(self) -> tuple[sqlite3.Connection, list[Task]]:
        """The pristine database and the tasks served from it, each with its expected answer."""
        pristine = build_database(self.seed, self.scale)
        suite = build_learning_suite(pristine) if self.suite == "learning" else build_suite(pristine)
        if self.family:
            wanted = {f.strip() for f in self.family.split(",") if f.strip()}
            unknown = wanted - {t.family for t in suite}
            if unknown:
                raise ValueError(f"--family: no such family in the {self.suite} suite: {', '.join(sorted(unknown))}")
            suite = [t for t in suite if t.family in wanted]
        tasks = Split(self.split, self.side).select(suite)
        if not tasks:
            raise ValueError("the split leaves no task on this side")
        return pristine, tasks


class Settings(TaskSuite):
    """What `refenv serve` runs with (the task-suite settings first, from `TaskSuite`)."""

    listen: ListenAddress = Field("127.0.0.1:8090", description="where to listen; port 0: one the system picks")
    port_file: PortFile = Field(None, description=PORT_FILE_HELP)
    pool: int = Field(2, ge=1, description="worlds, i.e. episodes held at once")
    step: bool = Field(False, description="step mode: park every model call for the driver")
    step_timeout: Annotated[float, Flag(metavar="DURATION", default_text="5m")] = Field(
        300.0, gt=0, description="idle deadline of a parked episode, and the wait for its next observation"
    )
    reward_profile: str = Field("rl", description=f"the default reward profile: {' or '.join(PROFILES)}")
    responder: bool = Field(False, description="after the answer, ask a responder stage to phrase it (not graded)")
    support_model: Annotated[str | None, Flag(metavar="URL,NAME")] = Field(
        None,
        description="answer the responder stage (and, without --step, every stage) from this OpenAI-compatible server",
    )
    latency_ms: float = Field(
        0.0, ge=0, description="fault injection: time each step (each action the model sends) spends executing"
    )
    fail_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="fault injection: fraction of episodes that fail as "
        "transport_error, environment_failure or HTTP 500",
    )
    token: Annotated[str | None, Flag(metavar="TOKEN")] = Field(
        None,
        min_length=16,
        description="require `Authorization: Bearer TOKEN` on every route but /health (set it as "
        "REFENV_TOKEN: a flag shows in the process list)",
    )
    token_file: Annotated[str | None, Flag(metavar="PATH")] = Field(
        None,
        description="read the token from this file (a secret mounted as a file; compose writes one): its "
        "first line, at least 16 characters; instead of --token",
    )
    log_level: Annotated[str, Flag(env=False)] = Field("warning", description="uvicorn log level")

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @model_validator(mode="after")
    def _token_from_file(self) -> Settings:
        if self.token_file is None:
            return self
        if self.token is not None:
            raise ValueError("give the token once: --token (REFENV_TOKEN) or --token-file (REFENV_TOKEN_FILE)")
        try:
            with open(self.token_file, encoding="utf-8") as file:
                token = file.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--token-file {self.token_file}: cannot be read ({type(exc).__name__})") from None
        if len(token) < 16:
            raise ValueError(f"--token-file {self.token_file}: its first line is not a token of at least 16 characters")
        self.token = token
        return self

    @field_validator("step_timeout", mode="before")
    @classmethod
    def _duration(cls, value: object) -> object:
        return parse_duration(value) if isinstance(value, str) else value

    @field_validator("reward_profile")
    @classmethod
    def _check_profile(cls, value: str) -> str:
        if value not in PROFILES:
            raise ValueError(f"must be one of {', '.join(PROFILES)}")
        return value

    @property
    def step_timeout_s(self) -> float:
        return self.step_timeout


TEACHER_ENV_PREFIX = "REFENV_TEACHER_"


class TeacherSettings(BaseModel):
    """What `refenv teacher` runs with, besides its `TaskSuite` (which it reads as `refenv serve` does)."""

    model_config = ConfigDict(extra="forbid")

    listen: ListenAddress = Field("127.0.0.1:8093", description="where to listen; port 0: one the system picks")
    port_file: PortFile = Field(None, description=PORT_FILE_HELP)
    name: str = Field("oracle-teacher", min_length=1, description="the model name it serves (in /v1/models)")
    log_level: Annotated[str, Flag(env=False)] = Field("warning", description="uvicorn log level")
