"""TRL's `GRPOTrainer` generating through the service: a `rollout_func` over a RolloutClient.

    from rollout_service.trainer import RolloutClient
    from rollout_service.trainer.trl import env_reward, service_rollout, task_dataset, use_service_logprobs

    client = RolloutClient("http://127.0.0.1:8080")
    rollout = service_rollout(client, adapter_dir="/shared/adapters")
    trainer = GRPOTrainer(model, reward_funcs=env_reward, train_dataset=task_dataset(client),
                          args=GRPOConfig(...), peft_config=LoraConfig(...), rollout_func=rollout)
    use_service_logprobs(trainer)  # optional: TRL's importance-sampling correction on the service's logprobs
    trainer.train()

The dataset's `prompt` column is a task id (or slug): TRL hands `rollout_func` only the prompts, each
repeated `num_generations` times in a row, so the prompt itself names the task. Each such run becomes
one group of the service; each attempt one row. TRL computes the advantages (its own group
normalisation of what `env_reward` returns) and the KL; the service gives it the tokens, the
behaviour logprobs, the env mask and the env's reward.

An attempt the env could not score (the infrastructure failed it, or it was cancelled) has no reward:
its row is a placeholder that trains nothing (one EOS token, `env_mask` 0) and `env_reward` returns
None for it. TRL reads None as NaN, leaves the row out of its group's mean and std and sets its
advantage to 0, so the other attempts of the group are normalised among themselves, exactly as the
service computes its own advantages. A 0.0 there would instead pull the group's baseline down.

Only this module imports TRL's conventions; it imports neither trl nor torch itself.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ..protocol import Attempt, GroupResult
from .client import RequestRejected, RolloutClient
from .sharded import ShardedClient
from .trajectory import NoTrajectory

__all__ = [
    "ServiceRollout",
    "env_reward",
    "service_rollout",
    "task_dataset",
    "trl_rows",
    "use_service_logprobs",
]

log = logging.getLogger(__name__)

# The fields each row carries besides TRL's own (prompt_ids, completion_ids, logprobs, env_mask);
# TRL forwards them to the reward functions as keyword arguments.
EXTRA_FIELDS = ("env_reward", "policy_version", "status", "group_id", "task_id")


class _Client(Protocol):
    def groups(self, requests: Any) -> Any: ...
    def update_policy(self, version: str, *, lora: str | None = None, weights: str | None = None) -> Any: ...


def task_dataset(client: RolloutClient, *, key: Literal["task_id", "slug"] = "task_id", side: str = "train") -> Any:
    """A `datasets.Dataset` with one row per task the service serves on `side` (its `prompt` is the
    task's id or slug): tasks from `GET /tasks`, kept when one of their envs is a `side` env in
    `GET /envs` (an admin-plane call: the client needs the admin key where the service has keys).
    An env that declares no side serves both."""
    from datasets import Dataset

    sided = {e.url for e in client.envs() if e.side in (None, side)}
    tasks = [t for t in client.tasks() if any(url in sided for url in t["envs"])]
    if not tasks:
        raise ValueError(f"the service serves no task on the {side!r} side (GET /tasks, GET /envs)")
    return Dataset.from_dict({"prompt": [t[key] for t in tasks]})


def env_reward(completions: list, env_reward: list[float | None], **_: Any) -> list[float | None]:
    """The reward function to give TRL: the env's reward of each row's attempt, None where the attempt
    could not be scored (TRL leaves those out of the group's normalisation)."""
    return list(env_reward)


def trl_rows(groups: Sequence[GroupResult | None], sizes: Sequence[int], *, eos_token_id: int) -> dict[str, list]:
    """`rollout_func`'s answer for these groups, one row per attempt in order; `None` for a group that
    failed as a whole (all of its `sizes[i]` rows are unscorable placeholders)."""
    out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", *EXTRA_FIELDS)}
    for group, size in zip(groups, sizes, strict=True):
        attempts = sorted(group.attempts, key=lambda a: a.index) if group is not None else []
        if group is not None and len(attempts) != size:
            raise ValueError(f"group {group.group_id}: {len(attempts)} attempts for {size} prompts")
        fallback_prompt = next((_prompt(a) for a in attempts if _prompt(a)), [eos_token_id])
        for i in range(size):
            attempt = attempts[i] if attempts else None
            prompt, completion, logprobs, mask = _row(attempt, fallback_prompt, eos_token_id)
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logprobs)
            out["env_mask"].append(mask)
            out["env_reward"].append(attempt.reward if attempt is not None else None)
            out["policy_version"].append(attempt.oldest_policy_version if attempt is not None else None)
            out["status"].append(attempt.status if attempt is not None else "group_failed")
            out["group_id"].append(group.group_id if group is not None else None)
            out["task_id"].append(group.task_id if group is not None else None)
    return out


def _prompt(attempt: Attempt) -> list[int]:
    segments = attempt.trajectory or []
    return segments[0].token_ids[: segments[0].prompt_tokens] if segments else []


def _row(attempt: Attempt | None, fallback_prompt: list[int], eos: int) -> tuple[list[int], list[int], list, list]:
    """One attempt's (prompt_ids, completion_ids, logprobs, env_mask): its first segment split at the
    first sampled token. A later segment (the env rewrote the history the policy saw) cannot continue
    this row's sequence; its tokens stay out of TRL's loss. Without a reward or a sampled token: a
    placeholder that trains nothing."""
    if attempt is None or attempt.reward is None:
        return (_prompt(attempt) if attempt is not None else []) or fallback_prompt, [eos], [0.0], [0]
    if attempt.tokens != "exact":
        raise NoTrajectory(
            f"attempt {attempt.index} ran with tokens={attempt.tokens}: it has no trajectory; the service must "
            "reach its model servers with token prompts (vLLM)"
        )
    segment = attempt.trajectory[0] if attempt.trajectory else None
    if segment is None or len(segment.token_ids) == segment.prompt_tokens:
        return _prompt(attempt) or fallback_prompt, [eos], [0.0], [0]
    cut = segment.prompt_tokens
    logprobs = [lp if lp is not None else 0.0 for lp in segment.logprobs[cut:]]
    return segment.token_ids[:cut], segment.token_ids[cut:], logprobs, list(segment.loss_mask[cut:])


def _runs(prompts: Sequence[Any], size: int) -> list[tuple[str, int]]:
    """Consecutive equal prompts as (task, count) groups of at most `size`: TRL repeats each prompt
    `num_generations` times in a row, and a group never mixes tasks."""
    runs: list[tuple[str, int]] = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise ValueError(
                f"a prompt must be a task id or slug (a string), not {type(prompt).__name__}: build the dataset "
                "with rollout_service.trainer.trl.task_dataset"
            )
        if runs and runs[-1][0] == prompt and runs[-1][1] < size:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


@dataclass
class ServiceRollout:
    """TRL's `rollout_func(prompts, trainer)`; see `service_rollout`."""

    client: _Client
    adapter_dir: Path
    key: Literal["task_id", "slug"] = "task_id"
    max_staleness: int = 0
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    request: dict[str, Any] = field(default_factory=dict)
    pushed_step: int | None = None
    version: str | None = None
    pushes: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        self.sync(trainer)
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        runs = _runs(prompts, size)
        requests = [self._request(task, n, trainer) for task, n in runs]
        results: list[GroupResult | None] = [None] * len(runs)
        for item in self.client.groups(requests):
            if item.error is not None:
                # A group the service could not run at all: its rows are unscorable, not zeros.
                log.warning(
                    "group %d (%s) failed: %s; its %d rows train nothing",
                    item.index,
                    runs[item.index][0],
                    item.error,
                    runs[item.index][1],
                )
            results[item.index] = item.group
        eos = trainer.processing_class.eos_token_id
        return trl_rows(results, [n for _, n in runs], eos_token_id=eos)

    def sync(self, trainer: Any) -> None:
        """Serve the trainer's adapter when the one served is more than `max_staleness` steps old (and
        before the first rollout): saved under `adapter_dir`, sent with POST /policy as `<run>-step<N>`."""
        step = trainer.state.global_step
        if self.pushed_step is not None and step - self.pushed_step <= self.max_staleness:
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not hasattr(model, "peft_config"):
            raise TypeError(
                "service_rollout serves the trainer's LoRA adapter: give GRPOTrainer a peft_config (or a PeftModel)"
            )
        accelerator = trainer.accelerator
        # Under accelerate every process holds the same adapter: the main one saves and serves it, and
        # every process records the name it was served under (the main process's run prefix, or a
        # resumed run's `.2`), which only the main process knows; none asks for groups before then.
        served: list[Any] = [None, None]
        if accelerator.is_main_process:
            served = list(self._serve(model, f"{self.run}-step{step}"))
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(served, from_process=0)
        version, result = served
        folder = (self.adapter_dir / version).resolve()
        self.pushed_step, self.version = step, version
        self.pushes.append({"step": step, "version": version, "folder": str(folder), "result": result})

    def _serve(self, model: Any, version: str) -> tuple[str, Any]:
        """Save and serve the adapter as `version`. A run resumed under the same `run` finds its
        step's name taken (a version is a label the service never reuses) and its folder written:
        it serves the adapter it holds now as `<version>.2`, `.3`... in a folder of its own, so no
        label ever names two adapters and no served folder is overwritten."""
        for attempt in range(1, 100):
            name = version if attempt == 1 else f"{version}.{attempt}"
            folder = (self.adapter_dir / name).resolve()
            if folder.exists():
                continue
            model.save_pretrained(str(folder), selected_adapters=[model.active_adapter])
            try:
                return name, self.client.update_policy(name, lora=str(folder))
            except RequestRejected as refused:
                if refused.error != "version_exists":
                    raise
            log.info("version %s is taken (a resumed run?): the adapter is served under the next free name", name)
        raise RuntimeError(f"{version} and {version}.2 to .99 are all taken (folders under {self.adapter_dir})")

    def _request(self, task: str, n: int, trainer: Any) -> dict[str, Any]:
        sampling = {
            "temperature": trainer.temperature,
            "top_p": trainer.top_p,
            "max_tokens": trainer.max_completion_length,
        }
        fields: dict[str, Any] = {
            self.key: task,
            "n": n,
            "tokens": "exact",
            # The policy's own logprobs, not renormalised by a grammar: the behaviour policy TRL corrects for.
            "constrained": False,
            # Nothing else moves the policy during a rollout: an attempt that did fell behind is re-run.
            "max_staleness": 0,
            # TRL's evaluation loop asks for its eval dataset's tasks: those the service keeps for
            # measurement (task_dataset(side="eval")), refused to training requests by default.
            "allow_eval_side": not trainer.model.training,
            **self.request,
        }
        fields["sampling"] = {**sampling, **self.request.get("sampling", {})}
        return fields


def service_rollout(
    client: RolloutClient | ShardedClient,
    *,
    adapter_dir: str | Path,
    key: Literal["task_id", "slug"] = "task_id",
    max_staleness: int = 0,
    run: str | None = None,
    **request: Any,
) -> ServiceRollout:
    """A `rollout_func` for TRL's GRPOTrainer that runs each prompt's `num_generations` attempts as one
    group of the service.

    - `adapter_dir`: where the trainer's LoRA adapter is saved before it is served; a folder the
      model servers read at the same path.
    - `max_staleness`: trainer steps the served adapter may lag behind the one being trained; 0
      pushes before the first rollout of every new `global_step`.
    - `run`: the versions' prefix (`<run>-step<N>`); default a fresh random one, so that two runs
      never name different adapters alike on shared model servers.
    - `request`: more GroupRequest fields (max_turns, timeout_s, sampling.seed...). The sampling
      temperature, top_p and max_tokens (per model call) are the trainer's own.
    """
    if max_staleness < 0:
        raise ValueError("max_staleness is a number of trainer steps, 0 or more")
    return ServiceRollout(
        client=client,
        adapter_dir=Path(adapter_dir),
        key=key,
        max_staleness=max_staleness,
        run=run or uuid.uuid4().hex[:8],
        request=request,
    )


class _ServedByTheService:
    """Stands where TRL keeps its own vLLM: the weights reach the model servers through POST /policy
    (ServiceRollout.sync), so TRL's weight sync has nothing to do."""

    def sync_weights(self) -> None:
        pass


def use_service_logprobs(trainer: Any) -> Any:
    """Turn on TRL's importance-sampling correction with the service's logprobs as the behaviour
    policy's. TRL applies `vllm_importance_sampling_correction` (and its `_mode`, `_clip_min`,
    `_clip_max`) only when it generates with vLLM itself (`use_vllm`), which would start or connect
    to a vLLM of its own; this marks the trainer as vLLM-backed without one. Call it after building
    the GRPOTrainer with `rollout_func=service_rollout(...)` and `use_vllm=False`."""
    if not isinstance(getattr(trainer, "rollout_func", None), ServiceRollout):
        raise ValueError("use_service_logprobs is for a GRPOTrainer whose rollout_func is service_rollout(...)")
    if trainer.loss_type == "vespo" and trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        # TRL's own check, which it makes only for a trainer built with use_vllm.
        raise ValueError("the vespo loss needs vllm_importance_sampling_mode token_truncate or token_mask")
    trainer.use_vllm = True
    trainer.vllm_generation = _ServedByTheService()
    trainer._last_loaded_step = -1
    return trainer
