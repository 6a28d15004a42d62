"""`refenv serve`: the command line, generated from `refenv.config.Settings`."""

from __future__ import annotations

import argparse
import sys

from rollout_service.flags import add_flags, parse_listen, settings_from

from .config import ENV_PREFIX, Settings


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
    return parser


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .server import create_app

    args = build_parser().parse_args(argv)
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
    host, port = parse_listen(settings.listen)
    uvicorn.run(app, host=host, port=port, log_level=settings.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
