"""The GPU-regime page's pictures, drawn from the records (bench/results/gpu-regime*.json).

    .venv/bin/python bench/plot_gpu_regime.py [--out docs/images]

gpu-regime-busy.png     simulated GPU busy % against pool (and replicas), one line per driver
gpu-regime-p90.png      p90 group latency (simulated s) against pool, one line per driver
gpu-regime-load.png     load per replica (generated tokens, max over mean) by driver and replica count

Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import ROOT, load_all

DRIVERS = ("naive", "sync", "batch", "stream")


def rows() -> list[dict]:
    """Every windowed gpu-regime row without item-5 switches; a configuration measured again keeps its
    newest row. Fixed-work runs (--groups) are left out: their figures include the drain at the end."""
    latest: dict[tuple, dict] = {}
    for rec in load_all():
        if rec["benchmark"] != "gpu-regime" or "--groups" in rec["command"].split():
            continue
        for row in rec["figures"]["rows"]:
            if row.get("switches"):
                continue
            latest[(row["driver"], row["pool"], row["replicas"])] = row
    return list(latest.values())


def by_pool(data: list[dict], figure: str, ylabel: str, title: str, out: Path) -> None:
    """One line per driver over the configurations measured (pool, then replicas), as categories:
    the runs here did not cover every pool at every replica count."""
    configs = sorted({(r["pool"], r["replicas"]) for r in data})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for driver in DRIVERS:
        mine = {(r["pool"], r["replicas"]): r.get(figure) for r in data if r["driver"] == driver}
        points = [(i, mine[c]) for i, c in enumerate(configs) if mine.get(c) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=driver)
    ax.set_xticks(range(len(configs)), [f"pool {p}\n{r} replica{'s' if r > 1 else ''}" for p, r in configs])
    ax.set_xlim(-0.5, len(configs) - 0.5)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def load(data: list[dict], out: Path) -> None:
    configs = sorted({(r["replicas"], r["pool"]) for r in data if r["replicas"] > 1})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(DRIVERS)
    for k, driver in enumerate(DRIVERS):
        mine = {(r["replicas"], r["pool"]): r["load max/mean"] for r in data if r["driver"] == driver}
        values = [mine.get(c) for c in configs]
        ax.bar([i + k * width for i in range(len(configs))], [v or 0 for v in values], width, label=driver)
    ax.axhline(1.2, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], [f"{r} replicas\npool {p}" for r, p in configs])
    ax.set_ylabel("tokens per replica: max / mean")
    ax.set_ylim(bottom=1.0)
    ax.set_title("Load per replica")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    data = rows()
    args.out.mkdir(parents=True, exist_ok=True)
    by_pool(data, "busy %", "simulated GPU busy %", "GPU busy", args.out / "gpu-regime-busy.png")
    by_pool(data, "p90 s", "p90 group latency (simulated s)", "Group latency", args.out / "gpu-regime-p90.png")
    load(data, args.out / "gpu-regime-load.png")


if __name__ == "__main__":
    main()
