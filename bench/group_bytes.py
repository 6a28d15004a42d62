"""The same groups asked of the service at two checkouts, against the same stand-ins: their JSON byte
for byte, apart from ids and times (a change to how the service reads answers or writes groups must
not change what a trainer gets).

    .venv/bin/python bench/group_bytes.py /path/to/a/checkout-of-main [--after DIR] [--record PATH]

The model server and env are bench/standins.py's (deterministic: the same observations, ids and
logprobs on every run); each checkout's service (`rollout-service serve`, run from that tree) is
started in turn and asked the same groups with `POST /groups`: exact and chat turns, a seed, several
turns an episode. In each group's JSON the values of the keys in VOLATILE (ids the service draws,
seconds measured) are blanked, then the two checkouts' bodies are compared as bytes. Prints each
group's verdict; exits 1 if any differs. `--record` writes the verdicts as a benchmark record.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

import httpx
import record
from ceiling import ROOT, Processes, _wait_up  # bench/ is on the path when this runs as a script

MODEL = "ceiling-model"  # the name bench/standins.py's model serves
GROUPS = [
    {"task_id": "t1", "n": 3, "tokens": "exact", "sampling": {"max_tokens": 64, "seed": 7}},
    {"task_id": "t1", "n": 3, "tokens": "chat", "sampling": {"max_tokens": 64, "seed": 7}},
    {"task_id": "t1", "n": 2, "tokens": "exact", "sampling": {"max_tokens": 1024}},
]
# Keys whose values the service draws (ids) or measures (seconds, times of day): blanked before the
# comparison.
IDS = ("group_id", "episode_id", "run_id")
VOLATILE = f"{', '.join(IDS)}, and every key ending in _s or _at"
_KEYS = b"|".join(k.encode() for k in IDS) + rb"|[a-z_]+_s|[a-z_]+_at"
_VOLATILE = re.compile(rb'"(' + _KEYS + rb')":("[^"]*"|[-0-9.eE+]+|null)')


def blank(body: bytes) -> bytes:
    return _VOLATILE.sub(rb'"\1":"-"', body)


async def groups_of(tree: Path, stack: Processes, urls: dict[str, str], name: str) -> list[bytes]:
    py = sys.executable
    port_file = stack.port_file(name)
    stack.start(
        name,
        [py, "-m", "rollout_service.tools.cli", "serve", "--env", urls["env"], "--vllm", urls["model"],
         "--model", MODEL, "--listen", "127.0.0.1:0", "--port-file", str(port_file)],
        env={"PYTHONPATH": str(tree)},
        cwd=tree,
    )  # fmt: skip
    url = stack.url(name, port_file)
    await _wait_up(f"{url}/health", stack.running[name])
    bodies = []
    async with httpx.AsyncClient(timeout=120.0) as http:
        for group in GROUPS:
            response = await http.post(f"{url}/groups", json=group)
            if response.status_code != 200:
                raise RuntimeError(f"{tree}: POST /groups {response.status_code}: {response.text[:300]}")
            bodies.append(response.content)
    stack.running.pop(name).terminate()
    return bodies


async def run(before: Path, after: Path) -> list[dict]:
    py = sys.executable
    with Processes(ROOT / "results" / "logs" / "group-bytes") as stack:
        ports = {name: stack.port_file(name) for name in ("model", "env")}
        stack.start("model", [py, "bench/standins.py", "model", "--port", "0", "--port-file", str(ports["model"]),
                              "--completion-tokens", "64"])  # fmt: skip
        stack.start("env", [py, "bench/standins.py", "env", "--port", "0", "--port-file", str(ports["env"]),
                            "--pool", "8", "--turns", "3", "--prompt-tokens", "500"])  # fmt: skip
        urls = {name: stack.url(name, ports[name]) for name in ("model", "env")}
        old = await groups_of(before, stack, urls, "service-before")
        new = await groups_of(after, stack, urls, "service-after")
    rows = []
    for group, a, b in zip(GROUPS, old, new, strict=True):
        same = blank(a) == blank(b)
        rows.append(
            {
                "tokens": group["tokens"],
                "n": group["n"],
                "max tokens": group["sampling"]["max_tokens"],
                "bytes before": len(a),
                "bytes after": len(b),
                "blanked values": len(_VOLATILE.findall(a)),
                "byte-equal (ids, times blanked)": same,
            }
        )
        print(rows[-1], flush=True)
        if not same:
            x, y = blank(a), blank(b)
            at = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            print(f"  first difference at byte {at}: {x[at - 80 : at + 80]!r}\n  vs {y[at - 80 : at + 80]!r}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path, help="the checkout to compare with (its service)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the checkout under test (default: this one)")
    parser.add_argument("--record", metavar="PATH", help="also write the verdicts as a benchmark record")
    args = parser.parse_args()
    rows = asyncio.run(run(args.before.resolve(), args.after.resolve()))
    if args.record:
        notes = (
            f"Each group asked with `POST /groups` of the service run from `{args.before}` (before) and from "
            f"`{args.after}` (after), against the same bench/standins.py stand-ins; blanked: the values of {VOLATILE}."
        )
        made = record.make("group_bytes", "A group's JSON before and after, byte for byte", rows, notes=notes)
        print(f"record written to {record.write(made, args.record)}")
    sys.exit(0 if all(r["byte-equal (ids, times blanked)"] for r in rows) else 1)


if __name__ == "__main__":
    main()
