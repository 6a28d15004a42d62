"""A reference trainer that learns through the rollout service, small enough for a 2-core CPU.

Plain PyTorch + transformers + peft: a LoRA adapter on the embedded SmolLM2-135M-Instruct, trained
in three stages, each through the service, with the policy measured on held-out task families
(`refenv --split auto:0.8 --side eval`) before and after each stage:

  1. distil: groups answered by a teacher (`--model-endpoint teacher=...`); SFT on the run log's
     `rollout-service export` (passing attempts, executor turns);
  2. rejection-sample: the tuned policy at T > 0; SFT on the best passing attempt of each group;
  3. GRPO: groups (`constrained: false`, so the returned logprobs are the policy's own; or, with
     `--grpo-constrained`, sampled under the env's JSON schema and the ratio taken against the
     trainer's own logprobs at the start of each step), a clipped importance-ratio loss over each
     trajectory's `loss_mask`, the service's advantages; the adapter is saved and sent with
     `POST /policy` after each step. `--grpo-mode sync` picks each step's
     tasks here and waits for their groups (no filter); `overlap` pulls each step's groups from a
     sampler stream (signal filter, difficulty bounds, `--max-staleness`) that generates the next
     step's while this one trains; `both` (default) runs sync steps first, then overlapped ones.

`--grpo-only` skips stages 1 and 2: GRPO from the base model. `--grpo-family NAME` runs the GRPO stage on
a family of refenv's learning suite (one-turn tasks the base model passes some of the time; docs/trl.md)
and measures that family's held-out instances before and during GRPO, so the GRPO stage's own effect is
seen apart from the public tasks the distil and RS stages are measured on.

With no larger model on this machine, the teacher is refenv's scripted oracle (`refenv teacher`),
which answers each task the way its hidden oracle does. With a real teacher the same commands apply.

    python examples/reference_trainer.py --out results/train            # starts the whole stack
    python examples/reference_trainer.py --smoke --out /tmp/train-smoke  # the mechanics, in minutes

Writes DIR/steps.jsonl (one JSON line per stage, step and measurement), DIR/summary.json,
DIR/progress.png (train reward, eval pass rate with 95% Wilson intervals and eval mean reward, against
step) and a bench record (DIR/record.json or --record PATH; examples/reference_report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import signal
import statistics
import sys
import time
import typing
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import reference_report

from rollout_service import ndjson
from rollout_service.launch import embedded_model
from rollout_service.launch.stack import LocalStack, refenv_command
from rollout_service.protocol import GRADED_STATUSES, Attempt, GroupResult
from rollout_service.sampler_protocol import MAX_IDLE_TIMEOUT_S, StreamState
from rollout_service.server.config import ServiceConfig
from rollout_service.tools.measure import run_measure
from rollout_service.trainer import RolloutClient, RolloutError, token_batch
from rollout_service.trainer.client import Sampled
from rollout_service.trainer.export import ExportOptions, export_sft

MODEL = embedded_model.MODEL_NAME
AGENT_SERVER = Path(__file__).resolve().parent / "agents" / "server.py"


def setting(default: Any, help: str) -> Any:
    """A field of Settings; its flag (`--name-with-dashes`) and help are made from it."""
    return field(default=default, metadata={"help": help})


@dataclass
class Settings:
    out: Path
    vllm: str | None = None
    grpo_only: bool = setting(False, "skip distillation and rejection sampling: GRPO from the base model")
    agent_example: bool = setting(
        False,
        "train through the agent lane: the example SQL agent server (examples/agents/server.py), in front of the "
        "train-side refenv, is the service's --env (with --grpo-only: the teacher answers step-mode episodes only)",
    )
    distil_groups: int = setting(44, "train tasks the teacher answers (each once)")
    distil_epochs: int = setting(2, "SFT epochs on the teacher's passing attempts")
    rs_groups: int = setting(16, "rejection sampling: tasks sampled")
    rs_n: int = setting(4, "rejection sampling: attempts per task")
    grpo_steps: int = setting(13, "GRPO steps in all (with --grpo-mode both: the sync ones first)")
    grpo_family: str | None = setting(
        None,
        "GRPO on this family of refenv's learning suite (e.g. learn-order-status): its training-side "
        "instances, measured on its held-out ones (default: the public tasks)",
    )
    grpo_mode: str = setting(
        "both",
        "sync: the trainer picks the tasks and waits for their groups, no filter (the way before the sampler); "
        "overlap: a sampler stream (signal filter, difficulty bounds) generates while the trainer trains; "
        "both: --grpo-sync-steps sync steps, then overlapped ones, so both are measured in one run",
    )
    grpo_sync_steps: int = setting(3, "with --grpo-mode both: GRPO steps run the sync way before the overlapped ones")
    groups_per_step: int = setting(6, "groups trained on per GRPO step")
    grpo_n: int = setting(4, "attempts per GRPO group")
    max_staleness: int = setting(1, "overlap: policy updates a trained group may be behind the current version")
    buffer: int | None = setting(None, "overlap: the stream's buffer bound (default 2 x --groups-per-step)")
    skip_pass_rate_above: float | None = setting(
        0.9, "overlap: skip a task whose recent pass rate is above this (it teaches little)"
    )
    skip_pass_rate_below: float | None = setting(
        None,
        "overlap: skip a task whose recent pass rate is below this (off by default: shaped rewards still "
        "differ on tasks never passed)",
    )
    pull_timeout_s: float = setting(
        1800.0, "overlap: a pull waits this long for its groups with signal, then the run stops and says so"
    )
    difficulty_after_groups: float = setting(2.0, "overlap: weighted groups before a task is judged by its pass rate")
    difficulty_versions: int = setting(4, "overlap: policy versions whose groups count for the pass rate")
    max_turns: int | None = setting(None, "per episode of the policy's groups and measurements (default: service's)")
    eval_repeats: int = setting(8, "attempts per eval task per measurement (8 x 11 eval tasks = 88)")
    eval_limit: int | None = setting(None, "measure only the first N eval tasks (default: all)")
    eval_every: int = setting(2, "GRPO steps between measurements")
    lr: float = setting(2e-4, "SFT learning rate")
    grpo_lr: float = setting(5e-5, "GRPO learning rate")
    grpo_constrained: bool = setting(
        False,
        "GRPO: groups sampled under the env's JSON schema (constrained: true), the importance ratio taken against "
        "the trainer's own logprobs at the start of each step (the service's are the grammar-masked ones); "
        "a base model's free-form answers are rarely actions, so its groups carry signal only so",
    )
    grpo_minibatches: int = setting(1, "GRPO: optimizer steps per GRPO step, each on a share of its trajectories")
    clip: float = setting(0.2, "GRPO importance-ratio clip")
    max_tokens: int = setting(96, "completion tokens per turn")
    temperature: float = setting(1.0, "sampling temperature of the policy's groups and measurements")
    seed: int = setting(7, "seeds the model, the task draws and the sampling")

    @classmethod
    def smoke(cls, out: Path, vllm: str | None) -> Settings:
        return cls(
            out=out,
            vllm=vllm,
            distil_groups=2,
            distil_epochs=2,
            rs_groups=2,
            rs_n=2,
            grpo_steps=4,
            grpo_sync_steps=1,
            groups_per_step=1,
            grpo_n=2,
            # One group pulled per step with two updates of staleness allowed: the paced stream keeps two
            # groups running while each step trains, so groups run across updates and are handed out
            # behind the policy: the staleness bound is exercised, not just stated.
            buffer=3,
            max_staleness=2,
            max_turns=2,  # answers the env rejects are asked again up to its limit: minutes on CPU
            eval_repeats=1,
            eval_limit=2,
            eval_every=100,  # once, after the last GRPO step
            max_tokens=32,
        )


def settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per setting, defaulting to None: a flag given overrides the settings (full or smoke)."""
    hints = typing.get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        if "help" not in f.metadata:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
            continue
        base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
        choices = ["sync", "overlap", "both"] if f.name == "grpo_mode" else None
        parser.add_argument(flag, type=base, choices=choices, default=None, help=f"{f.metadata['help']} ({f.default})")


@dataclass
class RunLog:
    """Every stage, step and measurement as one JSON line; the plot is drawn from it."""

    path: Path
    records: list[dict] = field(default_factory=list)

    def write(self, kind: str, **fields: Any) -> dict:
        record = {"kind": kind, "time": round(time.time(), 3), **fields}
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# -- the stack ---------------------------------------------------------------------------------------


class TrainStack(LocalStack):
    """vLLM, refenv's train side, its eval side, the oracle teacher and the service (with a run log)."""

    def __init__(
        self, out: Path, vllm: str | None, grpo_family: str | None = None, agent_example: bool = False
    ) -> None:
        self.teacher_port: int | None = None  # each bound by its server, read back as it starts
        self.eval_port: int | None = None
        self.grpo_family = grpo_family
        self.family_ports: dict[str, int] = {}  # --grpo-family: its train and eval sides
        self.agent_example = agent_example
        self.agent_port: int | None = None
        self.runs_dir = out / "runs"
        super().__init__(
            log_dir=out / "logs",
            pool=8,
            vllm_url=vllm,
            refenv_args=["--split", "auto:0.8", "--side", "train"],
            say=say,
        )

    @property
    def eval_url(self) -> str:
        return f"http://127.0.0.1:{self.eval_port}"

    def family_url(self, side: str) -> str:
        return f"http://127.0.0.1:{self.family_ports[side]}"

    @property
    def urls(self) -> dict[str, str]:
        # An agent server is just an env to the service: its URL takes refenv's place in --env.
        urls = super().urls
        if self.agent_port is not None:
            urls = {**urls, "refenv": urls["env"], "env": f"http://127.0.0.1:{self.agent_port}"}
        return urls

    def start(self) -> None:
        if self.vllm_url is None:
            self.start_vllm()
        teacher = [sys.executable, "-m", "refenv.cli", "teacher", "--listen", "127.0.0.1:0"]
        self.teacher_port = self.spawn_listening("teacher", teacher, "/v1/models")
        evaluation = refenv_command(0, "--pool", "8", "--split", "auto:0.8", "--side", "eval")
        self.eval_port = self.spawn_listening("refenv-eval", evaluation)
        self.service_args = [
            "--model-endpoint",
            f"teacher=http://127.0.0.1:{self.teacher_port},token-ids=false,model=oracle-teacher",
            "--runs-dir",
            str(self.runs_dir),
            "--run-id",
            "train",
            "--policy-stage",
            "executor",
        ]
        if self.grpo_family:
            suite = ["--suite", "learning", "--family", self.grpo_family, "--split", "auto:0.8"]
            for side in ("train", "eval"):
                command = refenv_command(0, "--pool", "8", *suite, "--side", side)
                self.family_ports[side] = self.spawn_listening(f"refenv-{self.grpo_family}-{side}", command)
            # The service trains on the family's training side; its eval side is measured apart, like the public one.
            self.service_args += ["--env", self.family_url("train")]
        self.start_refenv()
        if self.agent_example:
            agent = [sys.executable, str(AGENT_SERVER), "--refenv", self.urls["env"], "--listen", "127.0.0.1:0"]
            self.agent_port = self.spawn_listening("agent", agent)
            say(f"[agent] the example SQL agent at {self.urls['env']}, lent worlds by {self.urls['refenv']}")
        self.start_service()


# -- the model ---------------------------------------------------------------------------------------


class Policy:
    """The LoRA-adapted model the trainer updates, in float32 on the CPU."""

    def __init__(self, settings: Settings) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(settings.seed)
        folder = str(embedded_model.prepare())
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, config)
        self.settings = settings
        self.torch = torch
        self.trained_tokens = 0
        self.train_seconds = 0.0
        self.grpo_steps = 0
        self._grpo_optimizer: Any = None

    def token_logprobs(self, ids: Any) -> Any:
        """log p(token t | tokens < t) for t >= 1, for one row of ids."""
        logits = self.model(ids[None]).logits[0, :-1].float()
        return self.torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0]

    def sft(self, records: list[dict], epochs: int, progress: str) -> list[float]:
        """Cross-entropy on each record's assistant turn (its prompt as the chat template renders it);
        the mean loss per epoch."""
        from tqdm import tqdm

        torch = self.torch
        examples = []
        for record in records:
            messages = record["messages"]
            prompt = self.tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
            whole = self.tokenizer.apply_chat_template(messages, tokenize=True)
            prompt, whole = list(_ids(prompt)), list(_ids(whole))
            if whole[: len(prompt)] == prompt and len(whole) > len(prompt):
                examples.append((torch.tensor(whole), len(prompt)))
        optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.settings.lr)
        self.model.train()
        losses = []
        rng = random.Random(self.settings.seed)
        started = time.monotonic()
        for epoch in range(epochs):
            rng.shuffle(examples)
            total = 0.0
            for ids, prompt_len in tqdm(examples, desc=f"{progress} epoch {epoch + 1}/{epochs}", leave=False):
                logprobs = self.token_logprobs(ids)
                loss = -logprobs[prompt_len - 1 :].mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                total += loss.item()
                self.trained_tokens += len(ids)
            losses.append(total / max(1, len(examples)))
        self.train_seconds += time.monotonic() - started
        self.model.eval()
        return losses

    def grpo_loss(self, batch: dict, row: int, old: Any) -> tuple[Any, dict]:
        """The clipped importance-ratio objective on one trajectory row (negated, as a loss), against
        `old` (the behaviour policy's logprobs of the row's tokens) and the service's advantage."""
        torch = self.torch
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :n]
        mask = batch["loss_mask"][row, 1:n].float()
        new = self.token_logprobs(ids)
        ratio = torch.exp(new - old)
        advantage = float(batch["advantages"][row])
        clipped = torch.clamp(ratio, 1 - self.settings.clip, 1 + self.settings.clip)
        objective = torch.minimum(ratio * advantage, clipped * advantage)
        loss = -(objective * mask).sum() / mask.sum().clamp(min=1)
        masked = mask.bool()
        return loss, {
            "ratio_mean": ratio[masked].mean().item() if masked.any() else 1.0,
            "tokens": int(mask.sum().item()),
            "length": n,
        }

    def grpo_step(self, attempts: list[Attempt]) -> dict:
        """One GRPO step on these attempts: `--grpo-minibatches` optimizer steps, each over its share of
        the trajectories. One optimizer for the whole stage, so Adam's moments carry from step to step
        (a fresh one would make every update a sign step of the learning rate's size). The first
        minibatch's ratios are the policy's drift since the groups were sampled (1 up to the two
        engines' agreement at lag 0; exactly 1 with --grpo-constrained, whose ratio is taken against
        these weights, so there the clip bounds only the step's own later minibatches); the later
        ones' show how far the step has moved the policy."""
        return self.grpo_update(token_batch(attempts, pad_token_id=self.tokenizer.pad_token_id or 0, tensors="pt"))

    def grpo_update(self, batch: dict) -> dict:
        """`grpo_step` on a token batch (`token_batch`'s tensors)."""
        torch = self.torch
        rows = batch["input_ids"].shape[0]
        if rows == 0:
            return {"rows": 0, "loss": None}
        if self._grpo_optimizer is None:
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            self._grpo_optimizer = torch.optim.AdamW(trainable, lr=self.settings.grpo_lr)
        optimizer = self._grpo_optimizer
        started = time.monotonic()
        old = [batch["old_logprobs"][row, 1 : int(batch["attention_mask"][row].sum())] for row in range(rows)]
        if self.settings.grpo_constrained:
            # Grammar-masked sampling: vLLM's logprobs are of the renormalised allowed tokens, not the
            # policy's. The ratio is taken against these weights as the step starts instead (as verl
            # recomputes old_log_prob with the actor): the first minibatch's ratios are 1.
            with torch.no_grad():
                old = [self.token_logprobs(batch["input_ids"][row, : len(old[row]) + 1]) for row in range(rows)]
        order = list(range(rows))
        random.Random(self.settings.seed + self.grpo_steps).shuffle(order)
        parts = max(1, min(self.settings.grpo_minibatches, rows))
        minibatches = [order[i::parts] for i in range(parts)]
        self.model.train()
        losses, ratios = [], []
        for minibatch in minibatches:
            for row in minibatch:
                loss, info = self.grpo_loss(batch, row, old[row])
                (loss / len(minibatch)).backward()
                losses.append(loss.item())
                ratios.append(info["ratio_mean"])
                self.trained_tokens += info["length"]
            optimizer.step()
            optimizer.zero_grad()
        self.grpo_steps += 1
        self.train_seconds += time.monotonic() - started
        self.model.eval()
        return {
            "rows": rows,
            "optimizer_steps": len(minibatches),
            "loss": statistics.mean(losses),
            "ratio_mean": statistics.mean(ratios),
            "ratio_mean_last_minibatch": statistics.mean(ratios[-len(minibatches[-1]) :]),
        }

    def agreement(self, attempts: list[Attempt]) -> dict:
        """|Δ logprob| between the service's logprobs and these weights' own, over the sampled tokens
        of the attempts' trajectories, split by whether the turn was grammar-constrained."""
        torch = self.torch
        deltas: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
        with torch.no_grad():
            for attempt in attempts:
                constrained = {t.index: t.constrained for t in attempt.turns}
                for segment in attempt.trajectory or []:
                    own = self.token_logprobs(torch.tensor(segment.token_ids))
                    for span in segment.turns:
                        key = "constrained" if constrained.get(span.turn) else "unconstrained"
                        for position in range(span.start, span.end):
                            returned = segment.logprobs[position]
                            if returned is not None:
                                deltas[key].append(returned - own[position - 1].item())
        return {key: _distribution(values) for key, values in deltas.items() if values}

    def save(self, folder: Path) -> str:
        self.model.save_pretrained(str(folder))
        return str(folder.resolve())


def _ids(encoded: Any) -> list[int]:
    """apply_chat_template's ids, whether it returns a list or a BatchEncoding."""
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _distribution(deltas: list[float]) -> dict:
    absolute = sorted(abs(d) for d in deltas)

    def pct(q: float) -> float:
        return round(absolute[min(len(absolute) - 1, int(q * len(absolute)))], 4)

    ratios = [math.exp(d) for d in deltas]  # π_service / π_trainer per token
    return {
        "tokens": len(deltas),
        "mean_abs": round(statistics.mean(absolute), 4),
        "mean_signed": round(statistics.mean(deltas), 4),
        "p50_abs": pct(0.5),
        "p99_abs": pct(0.99),
        "max_abs": round(absolute[-1], 4),
        "ratio_mean": round(statistics.mean(ratios), 4),
        "ratio_p01_p99": [
            round(sorted(ratios)[int(0.01 * len(ratios))], 4),
            round(sorted(ratios)[int(0.99 * (len(ratios) - 1))], 4),
        ],
    }


# -- the stages --------------------------------------------------------------------------------------


class Run:
    def __init__(self, settings: Settings, stack: TrainStack, client: RolloutClient) -> None:
        self.settings, self.stack, self.client = settings, stack, client
        self.log = RunLog(settings.out / "steps.jsonl")
        self.policy = Policy(settings)
        self.version = "base"
        self.step = 0
        tasks = client.tasks()
        family = stack.family_url("train") if settings.grpo_family else None
        self.train_tasks = sorted(t["task_id"] for t in tasks if family not in t["envs"])
        # The GRPO stage's tasks, and the eval side it is measured on (--grpo-family: the family's).
        self.grpo_tasks = sorted(t["task_id"] for t in tasks if family in t["envs"]) if family else self.train_tasks
        self.eval_url = stack.eval_url
        self.generated_tokens = 0
        self.generation_seconds = 0.0

    def groups(self, requests: list[dict], desc: str) -> list[GroupResult]:
        from tqdm import tqdm

        started = time.monotonic()
        results = []
        with tqdm(total=len(requests), desc=desc, leave=False) as bar:
            for item in self.client.groups(requests):
                if item.group is not None:
                    results.append(item.group)
                bar.update(1)
        self.generation_seconds += time.monotonic() - started
        self.generated_tokens += sum(g.completion_tokens for g in results)
        return results

    def sampling(self, seed: int) -> dict:
        return {"temperature": self.settings.temperature, "max_tokens": self.settings.max_tokens, "seed": seed}

    def request(self, task_id: str, n: int, seed: int, **fields: Any) -> dict:
        """A group of the policy's, sampled and bounded as the settings say."""
        if self.settings.max_turns:
            fields["max_turns"] = self.settings.max_turns
        return {"task_id": task_id, "n": n, "sampling": self.sampling(seed), **fields}

    def measure(self, stage: str) -> dict:
        model = MODEL if self.version == "base" else f"{MODEL}@{self.version}"
        config = ServiceConfig(env=[self.eval_url], vllm=[self.stack.urls["vllm"]], model=model)
        started = time.monotonic()
        import asyncio

        m = asyncio.run(
            run_measure(
                config,
                repeats=self.settings.eval_repeats,
                limit=self.settings.eval_limit,
                temperature=self.settings.temperature,
                max_tokens=self.settings.max_tokens,
                model=None,
                progress=lambda line: None,
                max_turns=self.settings.max_turns,
            )
        )
        record = self.log.write(
            "eval",
            stage=stage,
            step=self.step,
            version=self.version,
            pass_rate=m["pass_rate"],
            wilson95=m["wilson95"],
            mean_reward=m["mean_reward"],
            mean_reward_ci95=m["mean_reward_ci95"],
            passes=m["passes"],
            graded=m["graded"],
            tasks=m["tasks"],
            policy_failures=m["policy_failures"],
            unscorable=m["unscorable"],
            seconds=round(time.monotonic() - started, 1),
        )
        lo, hi = m["wilson95"]
        say(f"[eval] {stage}: pass rate {m['pass_rate']:.3f} [{lo:.3f}, {hi:.3f}] ({m['passes']}/{m['graded']})")
        return record

    def push(self, label: str) -> None:
        self.step += 1
        self.version = f"{label}-{self.step}"
        folder = self.policy.save(self.settings.out / "adapters" / self.version)
        result = self.client.update_policy(self.version, lora=folder)
        self.log.write("update", step=self.step, version=self.version, seconds=result.seconds)

    def sft_stage(self, stage: str, run_log: Path, best_of_group: bool, epochs: int) -> None:
        records_path = self.settings.out / f"sft-{stage}.jsonl"
        report = export_sft(
            run_log,
            records_path,
            ExportOptions(stage="executor", min_reward=0.7, best_of_group=best_of_group),
        )
        records = [json.loads(line) for line in ndjson.split(records_path.read_text()) if line.strip()]
        say(f"[{stage}] {'; '.join(report.lines())}")
        started = time.monotonic()
        losses = self.policy.sft(records, epochs, stage) if records else []
        self.push(stage)
        self.log.write(
            "sft",
            stage=stage,
            step=self.step,
            records=len(records),
            losses=losses,
            seconds=round(time.monotonic() - started, 1),
        )

    def distil(self) -> None:
        tasks = self.train_tasks[: self.settings.distil_groups]
        started = time.monotonic()
        groups = self.groups(
            [
                {"task_id": t, "n": 1, "model": "teacher", "allow_greedy": True, "sampling": self.sampling(i)}
                for i, t in enumerate(tasks)
            ],
            "distil: teacher groups",
        )
        self.log.write(
            "groups",
            stage="distil",
            step=self.step,
            **_reward_stats(groups),
            seconds=round(time.monotonic() - started, 1),
        )
        distilled = self._logged("distil", groups)
        self.sft_stage("distil", distilled, best_of_group=False, epochs=self.settings.distil_epochs)

    def rejection_sample(self) -> None:
        tasks = self.train_tasks[: self.settings.rs_groups]
        started = time.monotonic()
        groups = self.groups(
            [self.request(t, self.settings.rs_n, 100 + i) for i, t in enumerate(tasks)],
            "rejection sampling",
        )
        self.log.write(
            "groups",
            stage="rs",
            step=self.step,
            version=self.version,
            **_reward_stats(groups),
            seconds=round(time.monotonic() - started, 1),
        )
        self.sft_stage("rs", self._logged("rs", groups), best_of_group=True, epochs=1)

    def grpo_modes(self) -> list[str]:
        s = self.settings
        if s.grpo_mode == "both":
            sync = min(s.grpo_sync_steps, s.grpo_steps)
            return ["sync"] * sync + ["overlap"] * (s.grpo_steps - sync)
        return [s.grpo_mode] * s.grpo_steps

    def grpo(self) -> None:
        """GRPO steps, each on `groups_per_step` groups: sync steps pick their tasks and wait for them;
        overlapped ones pull from a sampler stream that keeps generating while the step trains. Every
        trained group's lag is checked against the trainer's own update log before it is trained on."""
        s = self.settings
        rng = random.Random(s.seed)
        # The trainer's update log, oldest first: the lag of a group is how far its oldest turn's version
        # is behind the last entry. It starts at the version the service serves now.
        self.updates = [self.client.policy().version]
        if s.grpo_family:  # from here on the measurements are of the family's held-out instances
            self.eval_url = self.stack.family_url("eval")
            self.measure("family")
        stream: StreamState | None = None
        try:
            for k, mode in enumerate(self.grpo_modes()):
                started = time.monotonic()
                if mode == "sync":
                    groups, generation = self.sync_groups(k, rng)
                    service_lags: list[int | None] = [None] * len(groups)
                    bound = 0
                else:
                    if stream is None:
                        stream = self.open_stream()
                    pulled = self.client.pull(stream.id, s.groups_per_step, timeout_s=s.pull_timeout_s)
                    generation = stream_generation(pulled)
                    if len(pulled.groups) < s.groups_per_step:
                        # A policy whose groups never differ (every attempt failed alike) gives GRPO nothing:
                        # a finding to report with the measurements so far, not a crash.
                        why = (
                            f"grpo step {k + 1}: the stream handed out {len(pulled.groups)} of {s.groups_per_step} "
                            f"groups: {pulled.summary.stopped}; dropped so far {generation['dropped']} of "
                            f"{generation['groups_run']} groups run"
                        )
                        self.log.write("grpo_stopped", step=self.step, grpo_step=k + 1, reason=why)
                        say(f"[grpo] stopped: {why}")
                        if k > 0 and k % s.eval_every != 0:  # the last step trained on is measured
                            self.measure(f"grpo {k}")
                        break
                    groups, service_lags, bound = pulled.groups, list(pulled.lags), s.max_staleness
                waited = time.monotonic() - started
                trained = [self.trained_group(g, lag) for g, lag in zip(groups, service_lags, strict=True)]
                too_old = [t for t in trained if t["lag"] > bound]
                if too_old:
                    raise RuntimeError(
                        f"grpo step {k + 1}: {len(too_old)} group(s) behind the policy by more than {bound} "
                        f"update(s): {too_old}"
                    )
                attempts = [a for g in groups for a in g.attempts]
                checking = time.monotonic()
                if k == 0:  # lag 0 on the first step: the weights here are the ones that generated
                    self.log.write("agreement", step=self.step, version=self.version, **self.policy.agreement(attempts))
                started += time.monotonic() - checking  # a check, not part of the step
                trained_on = self.version
                t0 = time.monotonic()
                info = self.policy.grpo_step(attempts)
                train_s = time.monotonic() - t0
                self.push("grpo")
                self.updates.append(self.version)
                stats = _reward_stats(groups)
                self.log.write(
                    "grpo",
                    step=self.step,
                    grpo_step=k + 1,
                    mode=mode,
                    trained_on=trained_on,
                    max_staleness=bound,
                    **info,
                    **stats,
                    wall_seconds=round(time.monotonic() - started, 2),
                    wait_seconds=round(waited, 2),
                    train_seconds=round(train_s, 2),
                    generation=generation,
                    trained=trained,
                )
                lags = [t["lag"] for t in trained]
                say(
                    f"[grpo] step {k + 1} ({mode}): mean reward {stats['mean_reward']}, loss {info['loss']}, "
                    f"lags {lags}, waited {waited:.1f}s"
                )
                if (k + 1) % s.eval_every == 0 or k + 1 == s.grpo_steps:
                    self.measure(f"grpo {k + 1}")
        finally:
            if stream is not None:
                try:
                    closed = self.client.close_stream(stream.id)
                    self.log.write("stream", **closed.model_dump())
                except RolloutError as exc:  # closing is tidying: the run's outcome is already decided
                    say(f"[grpo] closing the stream: {exc}")

    def sync_groups(self, k: int, rng: random.Random) -> tuple[list[GroupResult], dict]:
        """The way before the sampler: the trainer picks the tasks and waits for every group."""
        s = self.settings
        tasks = rng.sample(self.grpo_tasks, min(s.groups_per_step, len(self.grpo_tasks)))
        groups = self.groups(
            [
                self.request(t, s.grpo_n, 1000 * (k + 1) + i, constrained=s.grpo_constrained, max_staleness=0)
                for i, t in enumerate(tasks)
            ],
            f"grpo step {k + 1}: groups",
        )
        return groups, {
            "groups_run": len(groups),
            "with_signal": sum(has_signal(g) for g in groups),
            "attempts": sum(len(g.attempts) for g in groups),
            "completion_tokens": sum(g.completion_tokens for g in groups),
        }

    def open_stream(self) -> StreamState:
        s = self.settings
        template: dict[str, Any] = {
            "n": s.grpo_n,
            "sampling": {"temperature": s.temperature, "max_tokens": s.max_tokens},
            "constrained": s.grpo_constrained,
        }
        if s.max_turns:
            template["max_turns"] = s.max_turns
        fields: dict[str, Any] = {
            "buffer": s.buffer or 2 * s.groups_per_step,
            "max_staleness": s.max_staleness,
            "group": template,
            "filter": "signal",
            **({"tasks": {"task_ids": self.grpo_tasks}} if s.grpo_family else {}),
            "seed": s.seed,
            # A measurement between pulls takes minutes on a CPU: the longest a stream may wait.
            "idle_timeout_s": MAX_IDLE_TIMEOUT_S,
        }
        if s.skip_pass_rate_above is not None or s.skip_pass_rate_below is not None:
            fields["difficulty"] = {
                "skip_pass_rate_above": s.skip_pass_rate_above,
                "skip_pass_rate_below": s.skip_pass_rate_below,
                "after_groups": s.difficulty_after_groups,
                "versions": s.difficulty_versions,
            }
        stream = self.client.open_stream(**fields)
        self.log.write("stream", **stream.model_dump(), settings=fields)
        return stream

    def trained_group(self, group: GroupResult, service_lag: int | None) -> dict:
        """What the run log keeps of a group trained on: its lag by the trainer's update log (and the
        service's, for a pulled group), its turns' versions and whether it carries signal."""
        oldest = group.oldest_policy_version
        if oldest not in self.updates:
            raise RuntimeError(f"group {group.group_id}: its oldest turn's version {oldest!r} is not in {self.updates}")
        return {
            "group_id": group.group_id,
            "task_id": group.task_id,
            "oldest_version": oldest,
            "lag": len(self.updates) - 1 - self.updates.index(oldest),
            "service_lag": service_lag,
            "signal": has_signal(group),
            "rewards": group.rewards,
        }

    def _logged(self, stage: str, groups: list[GroupResult], timeout_s: float = 60.0) -> Path:
        """A run log of these groups alone (`runs/<stage>-only.jsonl`), taken from the service's run log
        once all of them are in it: the service answers a group first and writes it to the disk after."""
        wanted = {g.group_id for g in groups}
        run_log = self.stack.runs_dir / "train.jsonl"
        deadline = time.monotonic() + timeout_s
        while True:
            lines = {}
            if run_log.exists():
                for line in ndjson.split(run_log.read_text(encoding="utf-8")):
                    try:
                        group_id = json.loads(line).get("group_id")
                    except ValueError:  # the line being written
                        continue
                    if group_id in wanted:
                        lines[group_id] = line
            if len(lines) == len(wanted):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(wanted) - len(lines)} of {len(wanted)} {stage} groups are not in {run_log} after "
                    f"{timeout_s:g}s: GET /health/detail shows the run log's state"
                )
            time.sleep(0.2)  # the service's writer is one disk write behind
        path = self.stack.runs_dir / f"{stage}-only.jsonl"
        path.write_text("".join(lines[g.group_id] + "\n" for g in groups), encoding="utf-8")
        return path


def has_signal(group: GroupResult) -> bool:
    """The sampler's test: at least two graded rewards, and not all equal."""
    graded = [a.reward for a in group.attempts if a.status in GRADED_STATUSES and a.reward is not None]
    return len(graded) >= 2 and any(r != graded[0] for r in graded)


def stream_generation(pulled: Sampled) -> dict:
    """The stream's tally so far (its life, not this pull's: the pull summary's `stream`) and what
    this pull dropped, by reason."""
    life = pulled.summary.stream
    if life is None:
        raise RuntimeError("a pull's summary without its stream's state: is the service older than the trainer?")
    return {
        "groups_run": life.groups_run,
        "dropped": life.dropped,
        "attempts_dropped": life.attempts_dropped,
        "completion_tokens_dropped": life.completion_tokens_dropped,
        "skipped_tasks": {why: len(tasks) for why, tasks in life.skipped_tasks.items()},
        "dropped_this_pull": dict(Counter(d.reason for d in pulled.dropped)),
        "buffer": {"bound": life.buffer_bound, "buffered": life.buffered},
        "lag_histogram": life.lag_histogram,
    }


def _reward_stats(groups: list[GroupResult]) -> dict:
    rewards = [a.reward for g in groups for a in g.attempts if a.reward is not None]
    graded = [a for g in groups for a in g.attempts if a.status in GRADED_STATUSES]
    passes = sum(bool(a.pass_) for a in graded)
    return {
        "groups": len(groups),
        "attempts": sum(len(g.attempts) for g in groups),
        "mean_reward": round(statistics.mean(rewards), 4) if rewards else None,
        "train_pass_rate": round(passes / len(graded), 4) if graded else None,
        "with_gradient": sum(not g.all_equal for g in groups),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/train"), help="where logs, adapters and the plot go")
    parser.add_argument("--vllm", help="a running vLLM serving the embedded model with LoRA on (default: start one)")
    parser.add_argument("--smoke", action="store_true", help="tiny counts: the mechanics, not the learning")
    parser.add_argument(
        "--record", type=Path, help="write the bench record here (default OUT/record.json), e.g. under bench/results/"
    )
    settings_flags(parser)
    args = parser.parse_args(argv)
    # A SIGTERM ends the run like Ctrl-C does: through `with stack`, which stops every process it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    settings = Settings.smoke(args.out, args.vllm) if args.smoke else Settings(out=args.out, vllm=args.vllm)
    for f in dataclasses.fields(Settings):
        given = getattr(args, f.name, None)
        if given is not None and "help" in f.metadata:
            setattr(settings, f.name, given)
    (args.out / "steps.jsonl").unlink(missing_ok=True)
    code = reference_report.code_commit()  # the code this run runs, whatever is checked out when it ends
    stack = TrainStack(args.out, args.vllm, settings.grpo_family, settings.agent_example)
    started = time.monotonic()
    with stack, RolloutClient(stack.urls["service"], timeout_s=3600) as client:
        run = Run(settings, stack, client)
        stage_times: dict[str, float] = {}

        def distil() -> None:
            run.distil()
            run.measure("distil")

        def rejection_sample() -> None:
            run.rejection_sample()
            run.measure("rs")

        stages: list[tuple[str, Callable[[], object]]] = [("base", lambda: run.measure("base"))]
        if not settings.grpo_only:
            stages += [("distil", distil), ("rs", rejection_sample)]
        stages.append(("grpo", run.grpo))
        for name, action in stages:
            t0 = time.monotonic()
            say(f"== stage {name}")
            action()
            stage_times[name] = round(time.monotonic() - t0, 1)
        summary = {
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
            "stage_seconds": stage_times,
            "wall_seconds": round(time.monotonic() - started, 1),
            "generation_tokens_per_s": round(run.generated_tokens / max(run.generation_seconds, 1e-9), 1),
            "training_tokens_per_s": round(run.policy.trained_tokens / max(run.policy.train_seconds, 1e-9), 1),
            "evals": [r for r in run.log.records if r["kind"] == "eval"],
            "agreement": next((r for r in run.log.records if r["kind"] == "agreement"), None),
            # The service's own update log, for checking the lags against something the trainer did not count.
            "policy": client.policy().model_dump(mode="json"),
        }
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        title = "reference trainer: " + ("GRPO from the base model" if settings.grpo_only else "distil, RS, GRPO")
        reference_report.plot(run.log.records, args.out / "progress.png", title)
        bench = reference_report.bench_record(run.log.records, summary, sys.argv if argv is None else argv, code)
        record_path = args.record or args.out / "record.json"
        record_path.parent.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(bench, indent=1, ensure_ascii=False) + "\n")
    say(f"done: {args.out / 'summary.json'}, {args.out / 'progress.png'}, {record_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
