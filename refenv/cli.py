"""`refenv serve`: the command line, with GraphJin's flag names where GraphJin has the flag."""

from __future__ import annotations

import argparse
import re
import sys

import uvicorn

from .server import Settings, create_app


def parse_duration(text: str) -> float:
    """'300', '300s', '5m', '1h', '750ms', '1m30s' -> seconds (Go-style durations)."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 300s, 5m, 750ms)")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen takes HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refenv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the reference environment over HTTP")
    serve.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 8090),
                       help="HOST:PORT to listen on (default 127.0.0.1:8090)")
    serve.add_argument("--pool", type=int, default=2, help="worlds, i.e. episodes held at once (default 2)")
    serve.add_argument("--step", action="store_true", help="step mode: park every model call for the driver")
    serve.add_argument("--step-timeout", type=parse_duration, default=300.0,
                       help="idle deadline of a parked episode and wait for the next observation (default 5m)")
    serve.add_argument("--reward-profile", default="rl", help="rl (default) or benchmark")
    serve.add_argument("--suite", default="public", help="task suite; refenv has one: public")
    serve.add_argument("--seed", type=int, default=0, help="data and fault-injection seed (default 0)")
    serve.add_argument("--scale", type=int, default=1, help="data size multiplier (default 1)")
    serve.add_argument("--split", default=None, help="auto:F (by family, deterministic) or a JSON file "
                       '{"train": [...], "eval": [...]} of task ids, slugs or families')
    serve.add_argument("--side", choices=("train", "eval"), default=None, help="which side of --split to serve")
    serve.add_argument("--responder", action="store_true",
                       help="after the answer, ask a responder stage to phrase it (not graded)")
    serve.add_argument("--support-model", default=None, metavar="URL,NAME",
                       help="answer the responder stage from this OpenAI-compatible server")
    serve.add_argument("--latency-ms", type=float, default=0.0,
                       help="fault injection: time each step (each action the model sends) spends executing (default 0)")
    serve.add_argument("--fail-rate", type=float, default=0.0,
                       help="fault injection: fraction of episodes that fail as transport_error, "
                            "environment_failure or HTTP 500 (default 0)")
    serve.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings(
        pool=args.pool, step=args.step, step_timeout_s=args.step_timeout, reward_profile=args.reward_profile,
        seed=args.seed, scale=args.scale, split=args.split, side=args.side, latency_ms=args.latency_ms,
        fail_rate=args.fail_rate, responder=args.responder, support_model=args.support_model, suite=args.suite)
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"refenv: {exc}", file=sys.stderr)
        return 2
    host, port = args.listen
    env = app.state.env
    print(f"refenv: {len(env.tasks)} tasks, pool {settings.pool}, "
          f"{'step' if settings.step else 'hosted'} mode, listening on http://{host}:{port}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
