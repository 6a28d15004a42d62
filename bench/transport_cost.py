"""What one request through the service's HTTP transport costs its process, in instructions: counted,
not timed, so that it holds on a machine shared with others' builds (CPU time per request there
varies by 15% from run to run; the count by well under 1%).

    .venv/bin/python bench/transport_cost.py                                  # this checkout
    .venv/bin/python bench/transport_cost.py --trees . /path/to/a/checkout-of-main --record bench/results/NAME.json
    .venv/bin/python bench/transport_cost.py --pythons .venv/bin/python /path/to/py3.12-venv/bin/python

`--pythons`: the interpreters the client runs on, each a venv with the service's HTTP dependencies
(aiohttp, yarl, multidict, orjson, uvloop, pydantic: the versions matter, so pin this venv's); rows
say each one's version.

For each tree (its `rollout_service/backends/` is the one imported) and answer size, a client process sends POSTs
(a 500-id prompt as JSON, as an exact turn's completion) through `rollout_service.backends.transport.make_transport`
to an instant stand-in server in a process of its own (bench/standins.py's; its answer is JSON of
the given size), 32 at a time, and reads each answer as the service does (`HttpAnswer.json()`).
The client runs under valgrind's callgrind twice, for --few and --many requests; the difference of
the two instruction counts over the difference of the requests is what a request costs, the
process's start and imports left out. User-space instructions only: the kernel's work for the
sockets is not counted (the same for every tree). Needs valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

ROOT = Path(__file__).resolve().parents[1]
IN_FLIGHT = 32
PROMPT = list(range(500))


def _serve(port_file: Path, answer_bytes: int) -> None:
    """The stand-in on a port the system picks, written to `port_file` once it listens."""
    import standins

    answer = orjson.dumps({"text": "a" * max(0, answer_bytes - 12)})
    standins._serve(lambda method, path, body: (200, answer), 0, port_file)


async def _client(port: int, requests: int) -> None:
    from rollout_service.backends.transport import make_transport

    transport = make_transport(600.0)
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 128}
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            answer = await transport.request("POST", url, json=body)
            if answer.status != 200:
                raise RuntimeError(f"the stand-in answered {answer.status}")
            answer.json()

    try:
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    finally:
        await transport.aclose()


def _instructions(python: str, tree: Path, port: int, requests: int) -> int:
    """The client process's instructions for `requests` requests, imports and start included."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         python, __file__, "_client", str(port), str(requests)],
        env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"the client under valgrind failed ({out.returncode}): {out.stderr[-1500:]}")
    return int(found.group(1))


def _label(tree: Path) -> str:
    """The tree's folder and commit (`+dirty`: a variant measured uncommitted)."""
    return f"{tree.name} ({record.commit(tree)})"


def _version(python: str) -> str:
    """`python`'s version, once it is known to import what the client needs (before anything is counted)."""
    check = "import aiohttp, orjson, pydantic, uvloop, yarl, platform; print(platform.python_version())"
    out = subprocess.run([python, "-c", check], capture_output=True)
    if out.returncode != 0:
        raise SystemExit(f"transport_cost.py: {python} cannot run the client: {out.stderr.decode()[-500:]}")
    return out.stdout.decode().strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[ROOT], help="checkouts whose transport to count")
    parser.add_argument("--answer-bytes", type=int, nargs="+", default=[200, 60_000])
    parser.add_argument("--few", type=int, default=300)
    parser.add_argument("--many", type=int, default=1500)
    parser.add_argument("--pythons", nargs="+", default=[sys.executable], help="interpreters to run the client on")
    parser.add_argument("--record", metavar="PATH", help="also write the rows as a benchmark record")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("transport_cost.py counts instructions with valgrind, which is not installed", file=sys.stderr)
        return 2
    # Here, not at the top: the client processes import only their tree's `rollout_service`.
    from rollout_service.launch.stack import ManagedProcess, fresh_port_file

    trees = [tree.resolve() for tree in args.trees]
    pythons = {python: _version(python) for python in args.pythons}
    rows = []
    logs = ROOT / "results" / "logs"
    # A folder of this run's own: two runs at once must not read each other's port.
    with tempfile.TemporaryDirectory(prefix="transport_cost-") as ports:
        for answer_bytes in args.answer_bytes:
            port_file = fresh_port_file(Path(ports), "stand-in")
            server = ManagedProcess(
                "the stand-in server",
                [sys.executable, __file__, "_serve", str(port_file), str(answer_bytes)],
                logs / "transport_cost-stand-in.log",
            )
            try:
                server.start()
                port = server.wait_port(port_file, 30)
                first = None
                for python, version in pythons.items():
                    for tree in trees:
                        few = _instructions(python, tree, port, args.few)
                        many = _instructions(python, tree, port, args.many)
                        per_request = round((many - few) / (args.many - args.few))
                        first = first or per_request
                        rows.append(
                            {
                                "tree": _label(tree),
                                **({"python": version} if len(pythons) > 1 else {}),
                                "answer bytes": answer_bytes,
                                "instructions/request": per_request,
                                "ratio to the first row": round(per_request / first, 3),
                            }
                        )
                        print(f"{rows[-1]['tree']:>30} Python {version} {answer_bytes:>7} B: {per_request:>9,} "
                              "instructions a request", flush=True)  # fmt: skip
            finally:
                server.stop()
    if args.record:
        notes = (
            f"{args.many} and {args.few} requests, {IN_FLIGHT} in flight, each a POST of a {len(PROMPT)}-id prompt;"
            " user-space instructions of the client process, counted by callgrind."
        )
        made = record.make("transport_cost", "Instructions per request through the HTTP transport", rows, notes=notes)
        print(f"record written to {record.write(made, args.record)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        _serve(Path(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_client":
        import uvloop

        uvloop.run(_client(int(sys.argv[2]), int(sys.argv[3])))
    else:
        sys.exit(main())
