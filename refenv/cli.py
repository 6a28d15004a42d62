"""`refenv serve` and `refenv teacher`: the command line, generated from the models in `refenv.config`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from refenv.config import ENV_PREFIX, TEACHER_ENV_PREFIX, Settings, TaskSuite, TeacherSettings
from rollout_service.flags import add_flags, parse_listen, settings_from

TEACHER_HELP = (
    "serve a scripted oracle teacher: an OpenAI-compatible chat server that answers each refenv task "
    "the way its hidden oracle does (a stand-in for a larger teacher model; not a model)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refenv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve the reference environment over HTTP",
        description="Serve the reference environment. Every flag can also come from the "
        f"environment variable named in its help ({ENV_PREFIX}...).",
    )
    add_flags(serve, Settings, ENV_PREFIX)
    teacher = sub.add_parser(
        "teacher",
        help=TEACHER_HELP,
        description="A scripted oracle teacher, standing in for a larger teacher model on a machine that has "
        "none (e.g. CPU-only). It is a script, not a model: an OpenAI-compatible chat server (GET /v1/models, "
        "POST /v1/chat/completions) that recognizes a refenv task from the conversation and answers with its "
        "hidden oracle's SQL, then the expected answer (finalize: the answer; responder: one sentence). "
        "Anything else gets a 400. It returns no token ids or logprobs: name it to the service with "
        "token-ids=false, e.g. --model-endpoint teacher=http://127.0.0.1:8093,model=oracle-teacher,"
        "token-ids=false. With a real teacher the same service commands apply. Start it with the task-suite "
        f"flags of the env it answers (--seed, --scale, --split, --side: the same flags and {ENV_PREFIX}* "
        f"variables as refenv serve); its own flags read {TEACHER_ENV_PREFIX}* variables.",
    )
    add_flags(teacher, TeacherSettings, TEACHER_ENV_PREFIX)
    add_flags(teacher, TaskSuite, ENV_PREFIX)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "teacher":
        return _teacher(args)
    from refenv.server import create_app

    try:
        settings = settings_from(args, Settings, ENV_PREFIX)
        app = create_app(settings)
    except ValueError as exc:
        print(f"refenv: {exc}", file=sys.stderr)
        return 2
    env = app.state.env
    print(
        f"refenv: {len(env.tasks)} tasks, pool {settings.pool}, {'step' if settings.step else 'hosted'} mode, "
        f"listening on http://{settings.listen}",
        flush=True,
    )
    return _run(app, settings.listen, settings.port_file, settings.log_level)


def _teacher(args: argparse.Namespace) -> int:
    from refenv.teacher import create_app

    try:
        settings = settings_from(args, TeacherSettings, TEACHER_ENV_PREFIX)
        suite = settings_from(args, TaskSuite, ENV_PREFIX)
        app = create_app(settings, suite)
    except ValueError as exc:
        print(f"refenv teacher: {exc}", file=sys.stderr)
        return 2
    print(
        f"refenv teacher: scripted oracle (not a model) serving {settings.name!r} for "
        f"{len(app.state.oracle.tasks)} tasks, listening on http://{settings.listen}",
        flush=True,
    )
    return _run(app, settings.listen, settings.port_file, settings.log_level)


def _run(app, listen: str, port_file: str | None, log_level: str) -> int:
    """Serve until stopped, as uvicorn.run does (exit status 3: it never started listening)."""
    import uvicorn

    from rollout_service.listening import ReportingServer

    host, port = parse_listen(listen)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = ReportingServer(config, Path(port_file) if port_file else None)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
