"""The reference trainer's results, from its run log (`steps.jsonl`): the plot, and the bench record
whose tables the benchmarks page renders (bench/record.py, bench/render.py).

The GRPO comparison puts the two ways of getting groups side by side: `sync` (the trainer picks the
tasks and waits for every group, no filter) and `overlap` (a sampler stream with the signal filter and
difficulty bounds, generating while the trainer trains).
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Why a group was not trained on, beside the lack of signal: these still were generated.
_NO_SIGNAL = ("no_signal", "too_few_graded", "group_failed")


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 2) if values else None


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 3) if whole else None


def grpo_steps(records: list[dict]) -> list[dict]:
    """The GRPO step records in order, each marked `after_eval` when a measurement ran between it and
    the step before: an overlapped step after one finds its buffer filled during the measurement."""
    steps: list[dict] = []
    measured = False
    for record in records:
        if record["kind"] == "eval":
            measured = True
        elif record["kind"] == "grpo":
            steps.append({**record, "after_eval": measured and bool(steps)})
            measured = False
    return steps


def generation(steps: list[dict], n: int) -> dict:
    """What one mode generated to get its trained groups: groups run, those with signal, attempts."""
    if not steps:
        return {}
    if steps[0]["mode"] == "sync":
        run = sum(s["generation"]["groups_run"] for s in steps)
        signal = sum(s["generation"]["with_signal"] for s in steps)
        attempts = sum(s["generation"]["attempts"] for s in steps)
        return {"groups_run": run, "with_signal": signal, "attempts": attempts, "stale": 0, "skipped": 0}
    last = steps[-1]["generation"]  # a stream's tally is over its life
    run = last["groups_run"]
    signal = run - sum(last["dropped"].get(reason, 0) for reason in _NO_SIGNAL)
    return {
        "groups_run": run,
        "with_signal": signal,
        "attempts": run * n,
        "stale": last["dropped"].get("stale", 0),
        "skipped": sum(last["skipped_tasks"].values()),
    }


def grpo_comparison(records: list[dict], n: int) -> list[dict]:
    """One row per figure, a column per mode that ran."""
    steps = grpo_steps(records)
    modes = [m for m in ("sync", "overlap") if any(s["mode"] == m for s in steps)]
    by_mode = {m: [s for s in steps if s["mode"] == m] for m in modes}
    gen = {m: generation(by_mode[m], n) for m in modes}
    rows: list[dict[str, Any]] = []

    def row(figure: str, value: Any) -> None:
        rows.append({"figure": figure, **{m: value(m) for m in modes}})

    row("GRPO steps", lambda m: len(by_mode[m]))
    row("groups generated", lambda m: gen[m]["groups_run"])
    row("share of generated groups with signal", lambda m: _share(gen[m]["with_signal"], gen[m]["groups_run"]))
    row(
        "attempts spent per group with signal",
        lambda m: round(gen[m]["attempts"] / gen[m]["with_signal"], 2) if gen[m]["with_signal"] else None,
    )
    row(
        "share of trained groups with signal",
        lambda m: _share(
            sum(t["signal"] for s in by_mode[m] for t in s["trained"]), sum(len(s["trained"]) for s in by_mode[m])
        ),
    )
    row("groups dropped as stale (re-run)", lambda m: gen[m]["stale"])
    row("task draws skipped by difficulty", lambda m: gen[m]["skipped"])
    row("max_staleness", lambda m: by_mode[m][0]["max_staleness"])
    row("lag of every trained group (lag: groups)", lambda m: lag_histogram(by_mode[m]))
    row("max lag of a trained group", lambda m: max(t["lag"] for s in by_mode[m] for t in s["trained"]))
    row("wall time per GRPO step, mean (s)", lambda m: _mean([s["wall_seconds"] for s in by_mode[m]]))
    row(
        "wall time per step, steady (s): not the first, not after a measurement",
        lambda m: _mean([s["wall_seconds"] for s in by_mode[m][1:] if not s["after_eval"]]),
    )
    row("of which waiting for groups, mean (s)", lambda m: _mean([s["wait_seconds"] for s in by_mode[m]]))
    row("of which training, mean (s)", lambda m: _mean([s["train_seconds"] for s in by_mode[m]]))
    row("train mean reward per step", lambda m: [s["mean_reward"] for s in by_mode[m]])
    return rows


def lag_histogram(steps: list[dict]) -> dict[str, int]:
    counts = Counter(t["lag"] for s in steps for t in s["trained"])
    return {str(lag): counts[lag] for lag in sorted(counts)}


def _eval_row(record: dict, stage: str) -> dict:
    lo, hi = record["wilson95"]
    return {
        "stage": stage,
        "policy": record["version"],
        "eval passed": f"{record['passes']} / {record['graded']}",
        "pass rate": round(record["pass_rate"], 3) if record["pass_rate"] is not None else None,
        "95% interval": f"[{lo:.3f}, {hi:.3f}]",
        "eval mean reward": round(record["mean_reward"], 3) if record.get("mean_reward") is not None else None,
        "reward 95% interval": _interval(record.get("mean_reward_ci95")),
    }


def _interval(bounds: list[float] | None) -> str | None:
    return None if bounds is None else f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def _apart(a: list[float] | None, b: list[float] | None) -> bool | None:
    """Whether two 95% intervals do not overlap; None where either is missing."""
    if a is None or b is None:
        return None
    return a[0] > b[1] or b[0] > a[1]


_STAGE_NAMES = {
    "base": "base model",
    "distil": "after distillation",
    "rs": "after rejection sampling",
    "family": "before GRPO, on the --grpo-family held-out instances (as every later row)",
}


def eval_rows(records: list[dict]) -> list[dict]:
    """Each measurement, named by what came before it."""
    rows = []
    for record in (r for r in records if r["kind"] == "eval"):
        stage = record["stage"]
        if stage.startswith("grpo "):
            step = next(s for s in grpo_steps(records) if s["grpo_step"] == int(stage.split()[1]))
            stage = f"after GRPO step {step['grpo_step']} ({step['mode']})"
        rows.append(_eval_row(record, _STAGE_NAMES.get(stage, stage)))
    return rows


def grpo_effect(records: list[dict]) -> str | None:
    """GRPO's effect on the eval side in words: the measurement before it against the last one."""
    evals = [r for r in records if r["kind"] == "eval"]
    before = [r for r in evals if not r["stage"].startswith("grpo ")]
    after = [r for r in evals if r["stage"].startswith("grpo ")]
    if not before or not after:
        return None
    a, b = before[-1], after[-1]
    if a["pass_rate"] is None or b["pass_rate"] is None:
        return None
    apart = _apart(a["wilson95"], b["wilson95"])
    verdict = "the 95% intervals do not overlap" if apart else "the 95% intervals overlap: inside the noise"
    said = (
        f"GRPO's effect on the eval side: {a['passes']}/{a['graded']} passed before ({a['version']}) -> "
        f"{b['passes']}/{b['graded']} after ({b['version']}); {verdict}."
    )
    rewards = _apart(a.get("mean_reward_ci95"), b.get("mean_reward_ci95"))
    if rewards is not None:
        said += (
            f" Mean reward {a['mean_reward']:.3f} {_interval(a['mean_reward_ci95'])} -> {b['mean_reward']:.3f} "
            f"{_interval(b['mean_reward_ci95'])}: "
            + ("the intervals do not overlap." if rewards else "the intervals overlap: inside the noise.")
        )
    return said


# What a run's GRPO steps compared, by the modes they ran: the record's title and its table's.
_COMPARED = {
    frozenset({"sync", "overlap"}): (
        "sync vs sampler stream",
        "GRPO: the trainer picking tasks and waiting (sync) vs the sampler stream (overlap)",
    ),
    frozenset({"overlap"}): ("sampler stream", "GRPO: the sampler stream (overlap)"),
    frozenset({"sync"}): ("sync", "GRPO: the trainer picking tasks and waiting (sync)"),
}


def _bench_record_module() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import record
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return record


def code_commit() -> str:
    """The commit checked out now (`+dirty` where tracked files differ): read as a run starts."""
    return _bench_record_module().commit()


def bench_record(records: list[dict], summary: dict, argv: list[str], code: str | None = None) -> dict:
    """The run's record; `code`: the commit it ran (code_commit() at its start)."""
    record = _bench_record_module()
    settings = summary["settings"]
    stages = "GRPO from the base model" if settings["grpo_only"] else "distil, rejection sampling, GRPO"
    modes = frozenset(s["mode"] for s in grpo_steps(records))
    compared, table_title = _COMPARED.get(modes, ("no GRPO step", "GRPO"))
    waited = ", ".join(
        [*(["teacher", "RS"] if not settings["grpo_only"] else []), *(["sync GRPO"] if "sync" in modes else [])]
    )
    agreement = (summary.get("agreement") or {}).get("unconstrained")
    stopped = next((r["reason"] for r in records if r["kind"] == "grpo_stopped"), None)
    notes = [
        f"Eval: {settings['eval_repeats']} attempts per eval-side task per measurement, at temperature "
        f"{settings['temperature']}, task families unseen in training; 95% Wilson intervals.",
        grpo_effect(records),
        f"GRPO stopped early: {stopped}." if stopped else None,
        f"GRPO: {settings['grpo_steps']} steps of {settings['groups_per_step']} groups x {settings['grpo_n']}, "
        f"mode {settings['grpo_mode']}, "
        + (
            "sampled under the env's JSON schema (constrained), the ratio against the trainer's own logprobs at "
            "each step's start; "
            if settings.get("grpo_constrained")
            else "sampled freely (unconstrained), the ratio against vLLM's logprobs; "
        )
        + f"lr {settings['grpo_lr']}; the stream: buffer {settings['buffer'] or 2 * settings['groups_per_step']}, "
        f"max_staleness {settings['max_staleness']}, signal filter, difficulty skip above "
        f"{settings['skip_pass_rate_above']} / below {settings['skip_pass_rate_below']}. Each lag is counted "
        "by the trainer from its own update log and the group's oldest turn, and checked before training.",
        f"Whole run {summary['wall_seconds'] / 60:.0f} minutes; "
        + (
            f"generation {summary['generation_tokens_per_s']} completion tokens/s (over the groups waited for: "
            f"{waited}), "
            if summary["generation_tokens_per_s"]
            else ""
        )
        + f"training {summary['training_tokens_per_s']} tokens/s (float32, {settings.get('grpo_minibatches', 1)} "
        "optimizer step(s) a GRPO step); trainer and vLLM share the CPU, so the overlapped steps' generation "
        "competes with their training.",
    ]
    if agreement:
        notes.append(
            f"Logprob agreement before the first GRPO step over {agreement['tokens']} unconstrained tokens: "
            f"mean |Δ| {agreement['mean_abs']}, mean signed Δ {agreement['mean_signed']}."
        )
    rows = eval_rows(records)
    made = record.make(
        "reference_trainer",
        f"Reference trainer: {stages} on the embedded model, {compared}",
        rows,
        notes=" ".join(n for n in notes if n),
        argv=argv,
        code=code,
    )
    made["figures"]["tables"] = [
        {
            "title": table_title,
            "rows": grpo_comparison(records, settings["grpo_n"]),
        }
    ]
    return made


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    train = [r for r in records if r["kind"] in ("groups", "grpo") and r.get("mean_reward") is not None]
    ax.plot([r["step"] for r in train], [r["mean_reward"] for r in train], "-", color="C0", alpha=0.5)
    for mode, marker in (("sync", "o"), ("overlap", "^")):
        points = [r for r in train if r.get("mode") == mode]
        if points:
            ax.plot([r["step"] for r in points], [r["mean_reward"] for r in points], marker, color="C0",
                    label=f"train mean reward, GRPO {mode}")  # fmt: skip
    other = [r for r in train if r["kind"] == "groups"]
    if other:
        ax.plot([r["step"] for r in other], [r["mean_reward"] for r in other], "s", color="C0",
                label="train mean reward: the teacher's (distil), RS groups")  # fmt: skip
    evals = [r for r in records if r["kind"] == "eval" and r["pass_rate"] is not None]
    if evals:
        steps = [r["step"] for r in evals]
        rates = [r["pass_rate"] for r in evals]
        lows = [r["pass_rate"] - r["wilson95"][0] for r in evals]
        highs = [r["wilson95"][1] - r["pass_rate"] for r in evals]
        ax.errorbar(steps, rates, yerr=[lows, highs], fmt="s-", color="C1", capsize=4,
                    label="eval pass rate (95% Wilson)")  # fmt: skip
        rewarded = [r for r in evals if r.get("mean_reward") is not None]
        bounds = [r.get("mean_reward_ci95") or [r["mean_reward"]] * 2 for r in rewarded]
        ax.errorbar([r["step"] for r in rewarded], [r["mean_reward"] for r in rewarded],
                    yerr=[[r["mean_reward"] - b[0] for r, b in zip(rewarded, bounds, strict=True)],
                          [b[1] - r["mean_reward"] for r, b in zip(rewarded, bounds, strict=True)]],
                    fmt="d--", color="C2", capsize=3, label="eval mean reward (95% interval)")  # fmt: skip
    ax.set_xlabel("policy version (step)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
