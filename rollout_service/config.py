"""Service configuration: flags, each also settable from an environment variable."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ServiceConfig(BaseModel):
    """What `rollout-service serve` runs with."""

    envs: list[str] = Field(min_length=1)
    vllm: list[str] = Field(min_length=1)
    model: str
    support_vllm: list[str] = Field(default_factory=list)
    support_model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key_env: str | None = None
    max_requests_per_second: float | None = Field(None, gt=0)
    max_n: int = Field(64, ge=1)
    max_batch: int = Field(1024, ge=1)
    max_body_bytes: int = Field(8 << 20, ge=1024)
    inference_timeout_s: float = Field(300.0, gt=0)
    policy_stages: list[str] = Field(default_factory=lambda: ["executor"])
    startup_timeout_s: float = Field(30.0, gt=0)


# flag -> environment variable, for the CLI and the README.
ENV_VARS = {
    "env": "ROLLOUT_ENV",
    "vllm": "ROLLOUT_VLLM",
    "model": "ROLLOUT_MODEL",
    "support_vllm": "ROLLOUT_SUPPORT_VLLM",
    "support_model": "ROLLOUT_SUPPORT_MODEL",
    "listen": "ROLLOUT_LISTEN",
    "api_key_env": "ROLLOUT_API_KEY_ENV",
    "max_requests_per_second": "ROLLOUT_MAX_RPS",
    "max_n": "ROLLOUT_MAX_N",
    "max_batch": "ROLLOUT_MAX_BATCH",
    "policy_stage": "ROLLOUT_POLICY_STAGES",
}
