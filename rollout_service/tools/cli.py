"""`rollout-service`: serve, demo, up, vllm, export, keys, env-token, vllm-key, measure, loadtest, ray.

What a command imports follows what it does: this module loads only the standard library, and each
command's flags and code are imported when that command is chosen. So `rollout-service vllm` (the
vLLM image's entrypoint, installed with the `vllm` extra only) and `keys` never load the service,
its settings or its HTTP stack (tests/test_images.py holds each image to what it installs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path


def _add_serve(p: argparse.ArgumentParser) -> None:
    from ..flags import add_flags
    from ..server.config import ENV_PREFIX, ServiceConfig

    p.description = (
        "Run the rollout service. Every flag can also come from the environment variable named in its help; "
        "lists there are comma-separated (--model-endpoint: ';'-separated)."
    )
    add_flags(p, ServiceConfig, ENV_PREFIX)


# The service's heap is large and long-lived (each attempt in flight holds its turns' token ids), and
# CPython's default collection (a young pass every 700 allocations, older passes scanning that heap)
# took 3.4-3.9 ms of CPU per turn where these thresholds take 2.0-2.2 at 1,024 episodes in flight
# (bench/ceiling.py; docs/benchmarks.md). Full passes still run, every ~200M allocations.
GC_THRESHOLDS = (100_000, 20, 100)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..flags import parse_listen, settings_from
    from ..listening import ReportingServer
    from ..server.config import ENV_PREFIX, ServiceConfig
    from ..server.http.app import create_app
    from ..server.logs import configure_logging

    class _Server(ReportingServer):
        """uvicorn's server, made to abandon running groups as soon as SIGTERM/SIGINT arrives
        rather than wait for groups that may run for minutes."""

        def handle_exit(self, sig, frame):
            cancel = getattr(getattr(self.config.app, "state", None), "cancel_running", None)
            if cancel is not None and not self.should_exit:
                cancel()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # where agent servers reach the attempts' model endpoint, port 0 resolved
                app.state.service.agents.listening_on(self.bound_port())

    try:
        config = settings_from(args, ServiceConfig, ENV_PREFIX)
        app = create_app(config)
    except ValueError as exc:
        print(f"rollout-service serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    host, port = parse_listen(config.listen)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=config.log_level,
            log_config=None,  # uvicorn's loggers go through the root handler: one format for all
            access_log=config.log_level == "debug",  # a line per request costs CPU at the ceiling
            timeout_graceful_shutdown=20,
        ),
        Path(config.port_file) if config.port_file else None,
    )
    # The service listens at once and waits for its envs and model servers (saying which, up to
    # --startup-timeout); if it gives up, or finds a misconfiguration, the server stops here.
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    gc.freeze()  # the imports, the app and its config live as long as the process: never scan them again
    gc.set_threshold(*GC_THRESHOLDS)
    server.run()
    failure = app.state.service.lifecycle.startup_failure
    if failure is not None:
        # Through logging, configured above: a JSON record under --log-format json, like every other line;
        # printed where --log-level leaves errors out, since an exit without a word says nothing.
        log = logging.getLogger("rollout_service.serve")
        if log.isEnabledFor(logging.ERROR):
            log.error("cannot start: %s", failure)
        else:
            print(f"rollout-service serve: cannot start: {failure}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def _add_vllm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="host (default 127.0.0.1)")
    p.add_argument(
        "--eager",
        action="store_true",
        help="do not compile the model (vLLM's --enforce-eager): starts faster, runs slower",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="weights and activations (default: bfloat16, or float32 on a CPU without native bf16, where "
        "vLLM's CPU build emulates bf16 at half the speed)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="require this key (the file's content, as `rollout-service vllm-key` writes it) on /v1/*: given to vLLM "
        "as $VLLM_API_KEY, never on its command line (compose sets it)",
    )


def _vllm(args: argparse.Namespace) -> int:
    from ..keys import VLLM_KEY_VAR
    from ..launch import embedded_model, vllm_server

    if vllm_server.installed_vllm() is None:
        print("rollout-service vllm: vLLM is not installed here (`make setup` installs the CPU build)", file=sys.stderr)
        return 2
    environment = vllm_server.vllm_environment(dev_mode=args.host in ("127.0.0.1", "localhost", "::1"))
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text().strip()
        except OSError as exc:
            print(f"rollout-service vllm: --api-key-file {args.api_key_file}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        if not key:
            print(f"rollout-service vllm: --api-key-file {args.api_key_file} is empty", file=sys.stderr)
            return 2
        environment[VLLM_KEY_VAR] = key
    model_dir = embedded_model.prepare()
    cmd = vllm_server.vllm_command(
        model_dir,
        served_name=embedded_model.MODEL_NAME,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        extra=["--enforce-eager"] if args.eager else None,
    )
    print(f"serving {embedded_model.MODEL_NAME} at http://{args.host}:{args.port}/v1 (Ctrl-C stops it)", flush=True)
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback:
        print("note: not on loopback, so vLLM's dev mode stays off: LoRA updates work, full-weight updates do not")
    os.execvpe(cmd[0], cmd, environment)


def _add_up(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-port", type=int, default=8000, help="vLLM's port (default 8000; 0: a free one)")
    p.add_argument("--env-port", type=int, default=8090, help="refenv's port (default 8090; 0: one it binds)")
    p.add_argument("--port", type=int, default=8080, help="the service's port (default 8080; 0: one it binds)")
    p.add_argument("--pool", type=int, default=8)
    p.add_argument("--vllm", default=None, metavar="URL", help="use this running model server instead")
    p.add_argument("--logs", type=Path, default=Path("results/logs"), help="log folder (default results/logs)")


def _up(args: argparse.Namespace) -> int:
    from ..launch.stack import LocalStack, StackError

    stack = LocalStack(
        log_dir=args.logs,
        pool=args.pool,
        vllm_port=args.vllm_port,
        refenv_port=args.env_port,
        service_port=args.port,
        vllm_url=args.vllm,
    )
    _stop_on_sigterm()
    try:
        with stack:
            urls = stack.urls
            print(
                f"\nup: service {urls['service']}  (docs {urls['service']}/docs)\n"
                f"    env     {urls['env']}\n    vLLM    {urls['vllm']}\n"
                f"try:  curl -s {urls['service']}/groups -H 'content-type: application/json' "
                f'-d \'{{"task_id": "t001", "n": 4, "sampling": {{"temperature": 0.8, "max_tokens": 64}}}}\'\n'
                "Ctrl-C stops everything.",
                flush=True,
            )
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


def _add_demo(p: argparse.ArgumentParser) -> None:
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


def _add_run_log(p: argparse.ArgumentParser) -> None:
    """The run log a command reads: `run` and --runs-dir (export, view)."""
    from ..server.config import ENV_PREFIX

    p.add_argument("run", help="a run id (in --runs-dir) or a path to a run log (.jsonl)")
    p.add_argument(
        "--runs-dir",
        type=Path,
        default=Path(os.environ.get(f"{ENV_PREFIX}RUNS_DIR") or "runs"),
        help=f"where run logs are (default runs, or ${ENV_PREFIX}RUNS_DIR)",
    )


def _add_export(p: argparse.ArgumentParser) -> None:
    _add_run_log(p)
    p.add_argument("--stage", default="executor", help="the stage whose turns to keep (default executor)")
    p.add_argument("--min-reward", type=float, default=0.0, help="keep attempts with reward >= this (default 0)")
    p.add_argument("--best-of-group", action="store_true", help="keep only each group's best attempt")
    p.add_argument("--allow-eval-side", action="store_true", help="also keep episodes from an eval-side env (!)")
    p.add_argument("--out", type=Path, required=True, help="output JSONL of {messages, meta}")


def _export(args: argparse.Namespace) -> int:
    from ..runs import find_run
    from ..trainer.export import ExportOptions, export_sft

    try:
        path = find_run(args.run, args.runs_dir)
        report = export_sft(
            path, args.out, ExportOptions(args.stage, args.min_reward, args.best_of_group, args.allow_eval_side)
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"rollout-service export: {exc}", file=sys.stderr)
        return 2
    if args.allow_eval_side:
        print(
            "WARNING: --allow-eval-side: records from the held-out side are included; "
            "measurements on that side are no longer held out",
            file=sys.stderr,
        )
    for line in report.lines():
        print(line)
    print(f"wrote {args.out}")
    return 0


def _add_view(p: argparse.ArgumentParser) -> None:
    _add_run_log(p)
    p.add_argument("--listen", default="127.0.0.1:8095", help="HOST:PORT (default 127.0.0.1:8095; port 0: any)")
    p.add_argument("--port-file", type=Path, help="once listening, write the port here")
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="the variable holding the key the page must send (needed off loopback: a run log holds every prompt)",
    )


def _view(args: argparse.Namespace) -> int:
    from ..viewer.serve import run

    return run(args)


def _add_keys(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write ROLLOUT_API_KEY= and ROLLOUT_ADMIN_KEY= lines to FILE (mode 0600, never through a "
        "symlink): the values of those variables where both are set here, else fresh random keys. A FILE "
        "that exists is kept as it is, unless both variables are set. compose and `ray up` do this; the "
        "service reads the file's variables (--api-key-env ROLLOUT_API_KEY --admin-key-env "
        "ROLLOUT_ADMIN_KEY) and the trainer the file (RolloutClient(url, key_file=FILE))."
    )
    p.add_argument("file", type=Path)


def _keys(args: argparse.Namespace) -> int:
    from ..keys import ensure_key_file

    return _write_secrets("keys", ensure_key_file, args.file)


def _write_secrets(command: str, ensure: Callable[[Path, Mapping[str, str]], Path], file: Path) -> int:
    """`keys` and `env-token`: the file written (or kept), or why not, as one line."""
    try:
        path = ensure(file, os.environ)
    except (OSError, ValueError) as exc:
        print(f"rollout-service {command}: {exc}", file=sys.stderr)
        return 1
    print(f"{command}: {path}")
    return 0


def _secret_file_command(
    ensure: str, description: str
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """`env-token` and `vllm-key`: one secret written to FILE and FILE.env by `keys.<ensure>`."""

    def add(p: argparse.ArgumentParser) -> None:
        p.description = description
        p.add_argument("file", type=Path)

    def run(args: argparse.Namespace) -> int:
        from rollout_service import keys

        return _write_secrets(args.command, getattr(keys, ensure), args.file)

    return add, run


_add_env_token, _env_token = _secret_file_command(
    "ensure_env_token",
    "Write the token the service sends its envs (refenv --token-file FILE) to FILE, and the line ENV_TOKEN=... "
    "to FILE.env (for --env-token-env ENV_TOKEN once a shell has read it): $ENV_TOKEN where set, else a fresh "
    "random token. A FILE that exists is kept as it is, unless ENV_TOKEN is set. compose does this.",
)
_add_vllm_key, _vllm_key = _secret_file_command(
    "ensure_vllm_key",
    "Write the key the model servers require (vLLM's --api-key; `rollout-service vllm --api-key-file FILE`) "
    "to FILE, and the line VLLM_API_KEY=... to FILE.env (for the service's --vllm-api-key-env VLLM_API_KEY "
    "once a shell has read it): $VLLM_API_KEY where set, else a fresh random key. A FILE that exists is "
    "kept as it is, unless VLLM_API_KEY is set. compose does this.",
)


def _add_measure(p: argparse.ArgumentParser) -> None:
    from ..protocol import GroupRequest
    from ..server.config import ENV_PREFIX

    p.add_argument("--env", required=True, action="append", metavar="EVAL_URL", help="eval-side env server")
    p.add_argument("--vllm", action="append", default=None, metavar="URL", help=f"model server [{ENV_PREFIX}VLLM]")
    p.add_argument("--model", default=None, help=f"model name [{ENV_PREFIX}MODEL]")
    p.add_argument("--repeats", type=int, default=2, help="attempts per task (default 2)")
    p.add_argument("--limit", type=int, default=None, help="measure only the first N tasks")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        metavar="N",
        help="model calls per episode before it counts as failed by the policy (default: a group's, "
        f"{GroupRequest.model_fields['max_turns'].default})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the env and model server to answer (default 60)",
    )


def _measure(args: argparse.Namespace) -> int:
    import json

    from pydantic import ValidationError

    from ..flags import settings_from
    from ..protocol import GroupRequest
    from ..server.config import ENV_PREFIX, ServiceConfig
    from ..server.errors import RequestRefused, StartupError
    from .measure import format_measurement, run_measure

    if args.repeats < 1:
        print("rollout-service measure: --repeats must be at least 1", file=sys.stderr)
        return 2
    if args.max_turns is not None:
        try:  # the group request it goes into holds the bounds
            GroupRequest.model_validate({"task_id": "-", "max_turns": args.max_turns})
        except ValidationError as exc:
            print(f"rollout-service measure: --max-turns: {exc.errors()[0]['msg']}", file=sys.stderr)
            return 2
    try:
        config = settings_from(
            argparse.Namespace(env=args.env, vllm=args.vllm, model=args.model, startup_timeout=args.startup_timeout),
            ServiceConfig,
            ENV_PREFIX,
            max_n=max(64, args.repeats),
            max_queued_attempts=max(65536, args.repeats),
        )
    except ValueError as exc:
        print(f"rollout-service measure: {exc}", file=sys.stderr)
        return 2
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    try:
        result = asyncio.run(
            run_measure(
                config,
                repeats=args.repeats,
                limit=args.limit,
                temperature=args.temperature,
                max_tokens=args.max_tokens,
                model=None,
                progress=say,
                max_turns=args.max_turns,
            )
        )
    except (StartupError, ValueError) as exc:
        print(f"rollout-service measure: {exc}", file=sys.stderr)
        return 1
    except RequestRefused as exc:  # a group the service's admission refuses (a task gone meanwhile)
        print(f"rollout-service measure: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rollout-service measure: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=1) if args.json else format_measurement(result))
    return 0


def _add_loadtest(p: argparse.ArgumentParser) -> None:
    p.add_argument("--service", default="http://127.0.0.1:8080", help="service URL (loopback only)")
    p.add_argument("--trainers", type=int, default=4, help="concurrent trainers (default 4)")
    p.add_argument("--batch", type=int, default=4, help="groups per batch request (default 4)")
    p.add_argument("--n", type=int, default=8, help="attempts per group (default 8)")
    p.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task ids to cycle through (default: every task the service's GET /tasks lists)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds to keep sending (default 60)")
    p.add_argument("--count", type=int, default=None, help="stop after this many groups instead")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="bearer token from this variable")
    p.add_argument(
        "--json", type=Path, default=Path("results/loadtest.json"), help="report (default results/loadtest.json)"
    )
    p.add_argument("--plot", type=Path, default=None, help="draw throughput, latency and occupancy to this PNG")


def _loadtest(args: argparse.Namespace) -> int:
    import json

    from .loadtest import LoadSpec, format_report, plot, run_load

    if min(args.trainers, args.batch, args.n) < 1:
        print("rollout-service loadtest: --trainers, --batch and --n must be at least 1", file=sys.stderr)
        return 2
    spec = LoadSpec(
        service=args.service.rstrip("/"),
        trainers=args.trainers,
        batch=args.batch,
        n=args.n,
        tasks=[t for t in (args.tasks or "").split(",") if t],
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_turns=args.max_turns,
        duration_s=None if args.count else args.duration,
        count=args.count,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
    )
    try:
        report = asyncio.run(run_load(spec))
    except (ValueError, OSError) as exc:
        print(f"rollout-service loadtest: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"report: {args.json}")
    if args.plot:
        try:
            plot(report, args.plot)
        except ValueError as exc:
            print(f"rollout-service loadtest: {exc}", file=sys.stderr)
            return 2
        print(f"plot: {args.plot}")
    return 0 if report["groups"] else 1


def _add_ray(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Place vLLM replicas, env servers and the service on an existing Ray cluster as named, "
        "detached actors (docs/operations.md, Ray). Each command connects to the cluster at "
        "--address, else $RAY_ADDRESS, else the local one."
    )
    actions = p.add_subparsers(dest="action", required=True)
    for name, text in (
        ("up", "start every piece the config names that is not running; the service last, wired to the others"),
        ("status", "each piece with its node, process and health, as JSON"),
        ("down", "stop every piece, the service first"),
        ("scale", "run N replicas or envs: new ones join the service, removed ones are drained first"),
        ("sync", "make the service's envs and replicas the pieces running now (after a restart elsewhere)"),
    ):
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument("--config", required=True, metavar="FILE", help="the cluster's YAML file")
        a.add_argument("--address", metavar="ADDR", help="the Ray cluster (default: $RAY_ADDRESS, else local)")
        if name == "scale":
            a.add_argument("--envs", type=int, metavar="N", help="run N env servers")
            a.add_argument("--replicas", type=int, metavar="N", help="run N policy replicas")
            a.add_argument(
                "--timeout", type=float, default=600.0, metavar="SECONDS", help="how long a removal may wait"
            )


def _ray(args: argparse.Namespace) -> int:
    import json

    try:
        import ray  # noqa: F401  (the extra's packages: say so here rather than deep in a command)
        import yaml  # noqa: F401

        from ..cluster import deploy
        from ..cluster.config import ConfigError, load_config
    except ImportError as exc:
        print(f"rollout-service ray: {exc}: install the extra, pip install 'rollout-service[ray]'", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"rollout-service ray: {exc}", file=sys.stderr)
        return 2
    if args.action == "scale" and args.envs is None and args.replicas is None:
        print("rollout-service ray scale: give --envs N and/or --replicas N", file=sys.stderr)
        return 2
    if args.action == "scale" and min(n for n in (args.envs, args.replicas, 1) if n is not None) < 0:
        print("rollout-service ray scale: counts cannot be negative", file=sys.stderr)
        return 2
    if args.action == "scale" and args.replicas == 0:
        print("rollout-service ray scale: the service needs at least one replica", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        deploy.connect(config, args.address)
        if args.action == "up":
            print(json.dumps(deploy.up(config, say), indent=2))
        elif args.action == "status":
            print(json.dumps(deploy.status(config), indent=2))
        elif args.action == "down":
            say(f"{deploy.down(config, say)} pieces stopped")
        elif args.action == "sync":
            deploy.sync(config, say)
        else:
            if args.replicas is not None:
                deploy.scale(config, "replica", args.replicas, say, args.timeout)
            if args.envs is not None:
                deploy.scale(config, "env", args.envs, say, args.timeout)
    except deploy.ClusterError as exc:
        print(f"rollout-service ray {args.action}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # Ray's own errors (an actor gone mid-command, a refused placement)
        print(f"rollout-service ray {args.action}: {type(exc).__name__}: {str(exc)[:1000]}", file=sys.stderr)
        return 1
    return 0


# Each command: its help line, what adds its flags, what runs it. Only the chosen command's flags are
# added (see `main`), so choosing a command imports nothing another one needs.
_Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, _Command] = {
    "serve": ("run the service (FastAPI on uvicorn)", _add_serve, _serve),
    "demo": ("run everything on this machine and show reward groups", _add_demo, _demo),
    "up": ("start vLLM, refenv (pool 8) and the service; keep them up until Ctrl-C", _add_up, _up),
    "vllm": ("prepare the embedded default model and run a local vLLM server for it", _add_vllm, _vllm),
    "export": ("write SFT records from a run log (distillation, rejection sampling)", _add_export, _export),
    "view": ("serve the run viewer over a run log, read-only (loopback by default)", _add_view, _view),
    "keys": ("write the service's two keys to FILE (mode 0600) unless it holds them already", _add_keys, _keys),
    "env-token": (
        "write the envs' token to FILE and FILE.env (mode 0600) unless FILE holds one already",
        _add_env_token,
        _env_token,
    ),
    "vllm-key": (
        "write the model servers' key to FILE and FILE.env (mode 0600) unless FILE holds one already",
        _add_vllm_key,
        _vllm_key,
    ),
    "measure": ("pass rate of the policy on an eval-side env, with a 95%% interval", _add_measure, _measure),
    "loadtest": ("drive a running service (on this machine) like a fleet of trainers", _add_loadtest, _loadtest),
    "ray": ("run the stack on a Ray cluster: up, scale, status, down (needs the `ray` extra)", _add_ray, _ray),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (`only`) one where just that command has its flags: the others are listed by
    name and help line, and choosing one of them is answered by `main` with its own parser."""
    parser = argparse.ArgumentParser(
        prog="rollout-service", description="vLLM-backed rollout service for RL post-training of agents"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add, _) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if only is None or name == only:
            add(p)
    return parser


def _chosen(argv: list[str]) -> str | None:
    """The command argv names: its first word that is not an option (the top level takes no values)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _chosen(argv)
    # An unknown or missing command gets argparse's own error, naming the choices, from the light parser.
    args = build_parser(only=command or "").parse_args(argv)
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
