"""`rollout-service export`: a run log to chat-format SFT records (distillation, rejection sampling)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..protocol import Attempt, GroupResult
from ..runs import read_groups


@dataclass
class ExportReport:
    kept: int = 0
    groups: int = 0
    attempts: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> turns (or attempts) dropped

    def lines(self) -> list[str]:
        out = [f"kept {self.kept} turn(s) from {self.attempts} attempt(s) in {self.groups} group(s)"]
        for reason, count in sorted(self.dropped.items()):
            out.append(f"dropped {count}: {reason}")
        return out


@dataclass
class ExportOptions:
    stage: str = "executor"
    min_reward: float = 0.0
    best_of_group: bool = False
    allow_eval_side: bool = False


def export_sft(run_log: Path, out: Path, opts: ExportOptions) -> ExportReport:
    """Write one JSON line per kept turn: {"messages": [...prompt..., assistant], "meta": {...}}."""
    report = ExportReport()
    _refuse_same_file(run_log, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside `out` and renamed over it at the end: an export that fails half-way leaves the old
    # file as it was, and `out` is never opened for writing (a symlink there is replaced, not followed).
    fd, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with open(fd, "w", encoding="utf-8") as sink:
            _write_records(run_log, sink, opts, report)
        os.replace(temporary, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return report


def _refuse_same_file(run_log: Path, out: Path) -> None:
    """Writing the output would empty the run log it reads: same device and inode, whatever the path
    (a symlink or a hard link to it included)."""
    try:
        source, target = os.stat(run_log), os.stat(out)
    except FileNotFoundError:
        return
    if (source.st_dev, source.st_ino) == (target.st_dev, target.st_ino):
        raise ValueError(f"--out {out} is the run log being exported ({run_log}): choose another file")


def _write_records(run_log: Path, sink, opts: ExportOptions, report: ExportReport) -> None:
    for group in read_groups(run_log):
        report.groups += 1
        if group.env.side == "eval" and not opts.allow_eval_side:
            report.dropped["attempts from an eval-side env (use --allow-eval-side to keep)"] += group.n
            continue
        for attempt in _eligible_attempts(group, opts, report):
            report.attempts += 1
            for record in _records(group, attempt, opts, report):
                sink.write(json.dumps(record) + "\n")
                report.kept += 1


def _eligible_attempts(group: GroupResult, opts: ExportOptions, report: ExportReport) -> list[Attempt]:
    scored = []
    for attempt in group.attempts:
        if attempt.status != "scored" or attempt.reward is None:
            report.dropped[f"unscored attempts ({attempt.status})"] += 1
        elif attempt.reward < opts.min_reward:
            report.dropped[f"attempts below --min-reward {opts.min_reward:g}"] += 1
        else:
            scored.append(attempt)
    if opts.best_of_group and scored:
        best = max(scored, key=lambda a: (a.reward, -a.index))
        report.dropped["attempts not the best of their group (--best-of-group)"] += len(scored) - 1
        return [best]
    return scored


def _records(group: GroupResult, attempt: Attempt, opts: ExportOptions, report: ExportReport):
    for turn in attempt.turns:
        if turn.stage != opts.stage:
            report.dropped[f"turns of other stages than {opts.stage!r}"] += 1
            continue
        if turn.model != group.model:
            report.dropped["turns not authored by the group's model (support model)"] += 1
            continue
        if not turn.messages:
            report.dropped["turns whose prompt was not recorded"] += 1
            continue
        yield {
            "messages": [*turn.messages, {"role": "assistant", "content": turn.completion}],
            "meta": {
                "run_id": group.run_id,
                "group_id": group.group_id,
                "task_id": group.task_id,
                "attempt": attempt.index,
                "turn": turn.index,
                "stage": turn.stage,
                "reward": attempt.reward,
                "model": group.model,
                "policy_version": turn.policy_version,
                "catalog_hash": group.env.catalog_hash,
                "reward_version": group.env.reward_version,
            },
        }
