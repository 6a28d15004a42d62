"""The cluster's YAML file (`rollout-service ray up --config FILE`), validated field by field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..launch import embedded_model

Kind = Literal["replica", "env", "service"]


class PieceSpec(BaseModel):
    """Where and how the pieces of one kind run. Piece i listens on `port + i` on its node."""

    model_config = ConfigDict(extra="forbid")
    count: int = Field(1, ge=0, le=256, description="how many to run")
    port: int = Field(ge=1, le=65535, description="the first one's port; piece i listens on port + i")
    command: list[str] | None = Field(
        None,
        min_length=1,
        description="the server's command line, with {host} and {port} filled in on its node; "
        "none: the built-in server",
    )
    ready_path: str = Field(pattern=r"^/", description="answers 200 once the server is up")
    startup_timeout_s: float = Field(gt=0, le=7200, description="how long it may take to answer ready_path")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs each reserves")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs each reserves")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each reserves")
    max_restarts: int = Field(3, ge=-1, description="times Ray restarts one that died (-1: always)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the server")

    @field_validator("command")
    @classmethod
    def _placeholders(cls, value: list[str] | None) -> list[str] | None:
        for part in value or []:
            try:
                part.format(host="h", port=1)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"{part!r}: only {{host}} and {{port}} are filled in; write a literal brace twice ({exc})"
                ) from None
        return value

    @field_validator("num_cpus", "num_gpus")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is not a custom resource: use num_cpus / num_gpus")
            if not math.isfinite(amount) or amount < 0:
                raise ValueError(f"{name}: {amount} is not a finite, non-negative amount")
        return value

    @model_validator(mode="after")
    def _ports_fit(self) -> PieceSpec:
        if self.port + max(self.count, 1) - 1 > 65535:
            raise ValueError(f"ports {self.port}..{self.port + self.count - 1} go past 65535: lower port")
        return self


class ReplicaSpec(PieceSpec):
    """Model server replicas serving the policy; built-in: the embedded default model on CPU vLLM."""

    port: int = Field(8000, ge=1, le=65535)
    ready_path: str = Field("/v1/models", pattern=r"^/")
    startup_timeout_s: float = Field(900.0, gt=0, le=7200)
    kv_cache_gib: int = Field(3, ge=1, description="the built-in server's KV cache (CPU build)")


class EnvSpec(PieceSpec):
    """Env servers speaking the step contract; built-in: refenv."""

    port: int = Field(8090, ge=1, le=65535)
    ready_path: str = Field("/health", pattern=r"^/")
    startup_timeout_s: float = Field(120.0, gt=0, le=7200)
    pool: int = Field(2, ge=1, description="the built-in refenv's pool (worlds at once)")
    args: list[str] = Field(default_factory=list, description="extra flags for the built-in `refenv serve`")


class ServiceSpec(PieceSpec):
    """The rollout service: one, wired to every replica and env."""

    count: int = Field(1, ge=1, le=1)
    port: int = Field(8080, ge=1, le=65535)
    ready_path: str = Field("/health", pattern=r"^/")
    startup_timeout_s: float = Field(600.0, gt=0, le=7200)
    args: list[str] = Field(default_factory=list, description="extra flags for `rollout-service serve`")
    command: None = Field(None, description="the service is always `rollout-service serve` (use args)")
    api_key_env: str | None = Field(
        None,
        description="the variable holding the service's API key (--api-key-env); with neither this nor "
        "admin_key_env, `ray up` generates both keys into keys_file",
    )
    admin_key_env: str | None = Field(
        None,
        description="the variable holding the service's admin key (--admin-key-env), sent by ray up, scale "
        "and sync; default: api_key_env's",
    )
    keys_file: str = Field(
        "~/.config/rollout-service/{namespace}.keys",
        description="where `ray up` writes the keys it generates (mode 0600; {namespace} is filled in), "
        "for the trainer (RolloutClient(url, key_file=...)) and later ray commands",
    )


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    namespace: str = Field(
        "rollout-service", pattern=r"^[A-Za-z0-9_.-]+$", description="the Ray namespace the pieces are named in"
    )
    model: str = Field(embedded_model.MODEL_NAME, min_length=1, description="the policy's served model name")
    logs_dir: str | None = Field(
        None,
        description="each node writes its pieces' logs and pid files here: a folder of the user Ray runs "
        "as, mode 0700 (refused otherwise); default: rollout-service-ray-<uid> in the node's temporary folder",
    )
    replicas: ReplicaSpec = Field(default_factory=ReplicaSpec)
    envs: EnvSpec = Field(default_factory=EnvSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)

    @model_validator(mode="after")
    def _ports_apart(self) -> ClusterConfig:
        ranges = [
            (kind, spec.port, spec.port + max(spec.count, 1) - 1)
            for kind, spec in (("replicas", self.replicas), ("envs", self.envs), ("service", self.service))
        ]
        for i, (a, lo_a, hi_a) in enumerate(ranges):
            for b, lo_b, hi_b in ranges[i + 1 :]:
                if lo_a <= hi_b and lo_b <= hi_a:
                    raise ValueError(f"{a} ports {lo_a}-{hi_a} overlap {b} ports {lo_b}-{hi_b}: move one port")
        return self

    def spec(self, kind: Kind) -> PieceSpec:
        return {"replica": self.replicas, "env": self.envs, "service": self.service}[kind]


class ConfigError(Exception):
    """The config file cannot be used; the message names each field that is wrong."""


def with_count(config: ClusterConfig, kind: Kind, count: int) -> ClusterConfig:
    """The config with `count` pieces of `kind`, checked again (ports that now overlap, past 65535)."""
    field = {"replica": "replicas", "env": "envs", "service": "service"}[kind]
    data = config.model_dump()
    data[field]["count"] = count
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{count} {field}: " + "; ".join(e["msg"] for e in exc.errors(include_url=False))) from None


def load_config(path: str | Path) -> ClusterConfig:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        ]
        raise ConfigError(f"{path}: {len(lines)} field(s) to fix:\n" + "\n".join(lines)) from None
