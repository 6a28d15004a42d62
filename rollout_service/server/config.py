"""The settings of `rollout-service serve`, each defined once here.

Flags, `ROLLOUT_*` environment variables, `--help` and the docs' configuration page are all
generated from `ServiceConfig` (see `rollout_service.flags`).
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..backends.kv_admission import KvMode
from ..backends.limits import DEFAULT_MAX_ANSWER_BYTES
from ..flags import PORT_FILE_HELP, Flag, ListenAddress, PortFile
from ..protocol import http_url
from ..runs import valid_run_id

ENV_PREFIX = "ROLLOUT_"

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["text", "json"]


class EndpointSpec(BaseModel):
    """A named model endpoint: `NAME=URL[,api-key-env=VAR][,model=SERVED][,token-ids=false]`."""

    name: str
    url: str
    api_key_env: str | None = None
    model: str | None = None  # the name the server knows it by; default NAME
    token_ids: bool = True  # ask for token ids and logprobs (vLLM); false for other servers

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @classmethod
    def parse(cls, text: str) -> EndpointSpec:
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"{text!r}: expected NAME=URL[,api-key-env=VAR][,model=SERVED][,token-ids=false]")
        url, *options = rest.split(",")
        fields: dict = {"name": name.strip(), "url": http_url(url.strip())}
        for option in options:
            key, sep, value = option.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in ("api_key_env", "model", "token_ids"):
                raise ValueError(
                    f"{text!r}: unknown option {option!r} (api-key-env=VAR, model=SERVED, token-ids=true|false)"
                )
            if key == "token_ids":
                flag = value.strip().lower()
                if flag not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"{text!r}: token-ids takes true or false, not {value!r}")
                fields[key] = flag in ("1", "true", "yes")
            else:
                fields[key] = value.strip()
        return cls(**fields)


class ServiceConfig(BaseModel):
    """What `rollout-service serve` runs with."""

    model_config = ConfigDict(extra="forbid")

    env: Annotated[list[str], Flag(metavar="URL")] = Field(
        min_length=1, description="environment servers speaking the step contract"
    )
    vllm: Annotated[list[str], Flag(metavar="URL")] = Field(
        min_length=1, description="policy model servers, one per replica"
    )
    model: str = Field(description="policy model name, as the model servers list it in /v1/models")
    support_vllm: Annotated[list[str], Flag(metavar="URL", default_text="the policy's servers")] = Field(
        default_factory=list, description="model servers for non-policy stages"
    )
    support_model: str | None = Field(None, description="model for non-policy stages; none: the policy answers them")
    listen: ListenAddress = Field(
        "127.0.0.1:8080", description="where to listen; loopback unless you say otherwise; port 0: one the system picks"
    )
    port_file: PortFile = Field(None, description=PORT_FILE_HELP)
    api_key_env: Annotated[str | None, Flag(metavar="VAR")] = Field(
        None,
        description="the data plane's key (trainers): require `Authorization: Bearer $VAR` on /groups, /tasks, "
        "GET /policy and every other path but /health and the admin plane's; with no --admin-key-env it "
        "guards the admin plane too",
    )
    admin_key_env: Annotated[str | None, Flag(metavar="VAR")] = Field(
        None,
        description="the admin plane's key (operators): require `Authorization: Bearer $VAR` on /envs*, "
        "/replicas*, POST /policy and /policy/pause; it may name the same variable as --api-key-env",
    )
    insecure_no_auth: bool = Field(
        False,
        description="start listening off loopback with a plane that has no key (warned at start and in "
        "/health/detail); without it the service refuses to",
    )
    allow_backends: Annotated[
        list[str], Flag(metavar="HOST|CIDR", default_text="loopback and the hosts of the backends given at start")
    ] = Field(
        default_factory=list,
        description="what POST /envs and POST /replicas may reach: host names, addresses and CIDRs; an added "
        "backend's host is resolved and every address it resolves to must be allowed (the hosts of the "
        "backends given at start always are)",
    )
    env_token_env: Annotated[str | None, Flag(metavar="VAR")] = Field(
        None, description="send `Authorization: Bearer $VAR` to every env (refenv --token; compose and ray up set it)"
    )
    vllm_api_key_env: Annotated[str | None, Flag(metavar="VAR")] = Field(
        None,
        description="send `Authorization: Bearer $VAR` to the policy's and support model servers (vLLM's "
        "--api-key; compose, ray up and rollout-service up set it); a replica added by POST /replicas gets it "
        "unless it names its own api_key_env",
    )
    replica_key_envs: Annotated[list[str], Flag(metavar="VAR")] = Field(
        default_factory=list,
        description="the variables POST /replicas may name as a replica's api_key_env (besides "
        "--vllm-api-key-env's): a key is read from the service's environment only under a name listed here, so "
        "the admin key cannot have any other variable of the service's (a cloud credential) sent to a backend",
    )
    max_requests_per_second: Annotated[float | None, Flag(metavar="R")] = Field(
        None, gt=0, description="cap on chat requests per second to each model route"
    )
    kv_admission: Annotated[KvMode, Flag(metavar="MODE")] = Field(
        "adaptive",
        description="bound on each replica's turns in flight: adaptive (from its /metrics: cut on preemptions or "
        "a full KV cache, raised while healthy), fixed (--kv-max-turns), off",
    )
    kv_max_turns: Annotated[int | None, Flag(metavar="N")] = Field(
        None, ge=1, description="turns in flight per replica with --kv-admission fixed"
    )
    kv_poll_interval: Annotated[float, Flag(metavar="SECONDS")] = Field(
        1.0, gt=0, description="how often each replica's /metrics is read for --kv-admission adaptive"
    )
    max_n: int = Field(64, ge=1, description="largest n a group may ask for")
    max_batch: int = Field(1024, ge=1, description="most groups in one POST /groups/batch")
    max_queued_attempts: int = Field(
        65536,
        ge=1,
        description="most attempts accepted and not yet finished, across all requests; a request that would "
        "pass it gets 429 with Retry-After, one with more attempts than the cap itself 422 too_many_attempts",
    )
    max_sampler_streams: int = Field(
        64,
        ge=1,
        description="most sampler streams open at once; POST /samplers past it gets 429 too_many_streams with "
        "Retry-After (when the soonest open stream would expire)",
    )
    max_sampler_streams_per_key: int = Field(
        32,
        ge=1,
        description="most sampler streams open at once that were opened with one key (the API key, the admin "
        "key; every caller counts as one where the data plane has no key): 429 too_many_streams_for_key",
    )
    max_sampler_buffer: int = Field(
        512,
        ge=1,
        description="most groups all sampler streams together may hold buffered or running (the sum of their "
        "`buffer`): a stream that would pass it gets 429 sampler_buffer_full",
    )
    stream_stall_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        120.0,
        gt=0,
        description="an NDJSON answer (POST /groups/batch, /groups/sample, a sampler pull) whose reader takes "
        "nothing for this long is cut off: its queued and running groups are cancelled, worlds released; a batch's "
        "or a sample's connection is reset (what was buffered for it dropped)",
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="request bodies over this get 413")
    agent_base_url: Annotated[str | None, Flag(metavar="URL", default_text="http://<--listen's host:port>")] = Field(
        None,
        description="where agent servers reach this service's per-attempt model endpoint: each attempt's "
        "base_url is URL/agent/<attempt id>/v1 (docs/agents.md)",
    )
    agent_max_body_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        4 << 20,
        ge=1024,
        description="an agent's chat completion body over this gets 413, read no further and never rendered",
    )
    max_answer_bytes: Annotated[int, Flag(metavar="BYTES")] = Field(
        DEFAULT_MAX_ANSWER_BYTES,
        ge=1 << 16,
        description="longest answer read from an env or a model server; a longer one is cut off as it comes and"
        " fails its turn (env_answer_too_large, inference_answer_too_large). The default holds 16 choices of"
        " 32,768 tokens with their ids and logprobs",
    )
    inference_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        300.0, gt=0, description="deadline of one completion"
    )
    policy_stage: Annotated[list[str], Flag(metavar="STAGE")] = Field(
        default_factory=lambda: ["executor"], min_length=1, description="stages the policy is trained on"
    )
    max_staleness: Annotated[int | None, Flag(metavar="UPDATES", default_text="unbounded")] = Field(
        None,
        ge=0,
        description="policy updates an attempt's oldest turn may be behind the current version when a "
        "request sets no max_staleness; an attempt further behind is re-run from reset",
    )
    max_loras: int = Field(
        4,
        ge=1,
        description="the policy replicas' vLLM --max-loras: groups pinned to earlier LoRA versions keep at most this "
        "many adapters loaded (the current one included); a pin past it gets 429 too_many_pins",
    )
    update_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        600.0, gt=0, description="deadline of one replica's part of a policy update (loading, reloading)"
    )
    pause_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        300.0, gt=0, description="lease of a POST /policy/pause that names no timeout_s"
    )
    max_pause_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        3600.0, gt=0, description="longest lease a POST /policy/pause may ask for (more: 422)"
    )
    startup_timeout: Annotated[float, Flag(metavar="SECONDS")] = Field(
        300.0,
        gt=0,
        description="how long to wait at start for every env and model server to answer (asked again "
        "with backoff; what is awaited is logged every 10 s, /health says starting meanwhile)",
    )
    model_endpoint: Annotated[list[EndpointSpec], Flag(metavar="NAME=URL[,OPTS]", separator=";")] = Field(
        default_factory=list,
        description='a named model a group may ask for with "model": NAME (a teacher on '
        "any OpenAI-compatible server); options api-key-env=VAR, model=SERVED, token-ids=false",
    )
    checkpoint_root: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None,
        description="POST /policy loads LoRA adapters and checkpoints only from folders under DIR (after "
        "resolving symlinks); unset: any folder the service can read",
    )
    runs_dir: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None, description="append every finished group to DIR/<run-id>.jsonl"
    )
    run_id: str | None = Field(None, description="run id (default generated); reuse one to append to its log")
    max_run_log_queue: int = Field(
        1024,
        ge=1,
        description="finished groups waiting to be written to the run log; past it, groups are "
        "dropped from the log (counted, /health degraded) rather than held in memory",
    )
    log_level: Annotated[LogLevel, Flag(metavar="LEVEL")] = Field(
        "info",
        description="the service's log level (debug, info, warning, error, critical); lifecycle events are "
        "info, debug adds uvicorn's access log",
    )
    log_format: Annotated[LogFormat, Flag(metavar="FORMAT")] = Field(
        "text", description="text (a line each, with the time) or json (one object a line, for log collectors)"
    )

    def vllm_api_key(self) -> str | None:
        """The key sent to the policy's and support model servers, or None (checked set: below)."""
        return os.environ.get(self.vllm_api_key_env) if self.vllm_api_key_env else None

    @model_validator(mode="after")
    def _vllm_key_set(self) -> ServiceConfig:
        # Fatal, unlike an unset env token: a keyed model server would answer every completion 401.
        if self.vllm_api_key_env and not self.vllm_api_key():
            raise ValueError(f"--vllm-api-key-env {self.vllm_api_key_env}: that variable is empty or unset")
        return self

    def env_token(self) -> str | None:
        """The token sent to the envs, or None (checked set at start: `create_app`)."""
        return (os.environ.get(self.env_token_env) or None) if self.env_token_env else None

    @field_validator("model_endpoint", mode="before")
    @classmethod
    def _parse_endpoints(cls, value: object) -> object:
        if isinstance(value, list):
            return [EndpointSpec.parse(v) if isinstance(v, str) else v for v in value]
        return value

    @field_validator("model_endpoint")
    @classmethod
    def _unique_endpoints(cls, value: list[EndpointSpec]) -> list[EndpointSpec]:
        names = [e.name for e in value]
        if len(set(names)) != len(names):
            raise ValueError("a name is given twice")
        return value

    @model_validator(mode="after")
    def _kv_cap_given(self) -> ServiceConfig:
        if self.kv_admission == "fixed" and self.kv_max_turns is None:
            raise ValueError("--kv-admission fixed needs --kv-max-turns N")
        return self

    @model_validator(mode="after")
    def _pause_within_its_maximum(self) -> ServiceConfig:
        if self.pause_timeout > self.max_pause_timeout:
            raise ValueError(
                f"--pause-timeout {self.pause_timeout:g} is over --max-pause-timeout {self.max_pause_timeout:g}"
            )
        return self

    @field_validator("checkpoint_root")
    @classmethod
    def _check_checkpoint_root(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isdir(value):
            raise ValueError(f"{value!r} is not a folder")
        return value

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str | None) -> str | None:
        if value is not None and not valid_run_id(value):
            raise ValueError(f"{value!r}: use letters, digits, '.', '_' and '-' only (it becomes a file name)")
        return value

    @field_validator("allow_backends")
    @classmethod
    def _check_allowed(cls, value: list[str]) -> list[str]:
        from ..backends.addresses import parse_allowed  # the one reading of an entry

        for entry in value:
            parse_allowed(entry)
        return value

    @field_validator("env", "vllm", "support_vllm")
    @classmethod
    def _no_duplicates(cls, value: list[str]) -> list[str]:
        stripped = [http_url(u).rstrip("/") for u in value]
        if len(set(stripped)) != len(stripped):
            raise ValueError("the same URL is given twice")
        return stripped
