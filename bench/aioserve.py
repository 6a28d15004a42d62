"""Serve an aiohttp app on loopback for the GPU-regime stand-ins (bench/gpusim.py, bench/tailenv.py),
writing the port bound to `--port-file` as the service and refenv do (rollout_service/listening.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from rollout_service.listening import write_port_file


def serve(make_app: Callable[[], web.Application], port: int, port_file: Path | None) -> None:
    """Run `make_app()` (called inside the event loop) on 127.0.0.1:`port` (0: one the system picks) until killed."""

    async def main() -> None:
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
        await site.start()
        if port_file is not None:
            write_port_file(port_file, site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())
