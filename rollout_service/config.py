"""Service configuration: flags, each also settable from an environment variable."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field


class EndpointSpec(BaseModel):
    """A named model endpoint: `NAME=URL[,api-key-env=VAR][,model=SERVED][,token-ids=false]`."""

    url: str
    api_key_env: str | None = None
    model: str | None = None  # the name the server knows it by; default NAME
    token_ids: bool = True  # ask for token ids and logprobs (vLLM); false for other servers

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @classmethod
    def parse(cls, text: str) -> tuple[str, "EndpointSpec"]:
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--model-endpoint {text!r}: expected NAME=URL[,api-key-env=VAR][,model=SERVED]")
        url, *options = rest.split(",")
        fields: dict = {"url": url}
        for option in options:
            key, sep, value = option.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in ("api_key_env", "model", "token_ids"):
                raise ValueError(f"--model-endpoint {text!r}: unknown option {option!r} "
                                 "(api-key-env=VAR, model=SERVED, token-ids=true|false)")
            fields[key] = value.strip().lower() in ("1", "true", "yes") if key == "token_ids" else value.strip()
        return name, cls(**fields)


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
    model_endpoints: dict[str, EndpointSpec] = Field(default_factory=dict)
    runs_dir: str | None = None
    run_id: str | None = None


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
    "inference_timeout": "ROLLOUT_INFERENCE_TIMEOUT",
    "model_endpoint": "ROLLOUT_MODEL_ENDPOINTS",
    "runs_dir": "ROLLOUT_RUNS_DIR",
    "run_id": "ROLLOUT_RUN_ID",
}
