"""A uvicorn server that says where it listens: with `--listen HOST:0` the system picks the port as the
server binds it, and `--port-file PATH` receives that port once the server accepts connections.

A launcher (launch/stack.py) that starts the service or refenv on port 0 reads the port back from the
file instead of choosing a free port itself and handing it over: a port found free and closed again
may be bound by anyone before the child binds it, a port the child binds is its own.
"""

from __future__ import annotations

import os
import socket
import struct
import weakref
from collections.abc import Iterable
from pathlib import Path

import uvicorn


class ReportingServer(uvicorn.Server):
    """uvicorn's server; once it listens, the port it bound is written to `port_file` (if any)."""

    def __init__(self, config: uvicorn.Config, port_file: Path | None = None) -> None:
        super().__init__(config)
        self.port_file = port_file
        _SERVING.add(self)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Written only now: the app's own start-up has run and the sockets accept connections, so a
        # launcher that reads the port may connect at once.
        if self.port_file is not None and self.started:
            write_port_file(self.port_file, self.bound_port())

    def bound_port(self) -> int:
        """The port of the first listening socket (the one `--listen` named, port 0 resolved)."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        raise RuntimeError("the server has no listening socket")


# The servers of this process, for `abort_connection`: an ASGI app is not handed its connection.
_SERVING: weakref.WeakSet[uvicorn.Server] = weakref.WeakSet()


def abort_connection(client: Iterable[object] | None) -> bool:
    """Close the connection from `client` (an ASGI scope's "client") at once, dropping what is still
    buffered for it; True if one was found. uvicorn closes an unfinished answer's connection with the
    transport's close(), which first waits for the buffer to be written: to a reader that takes
    nothing, never, so the connection and its buffer would stay."""
    if not client:
        return False
    peer = tuple(client)
    for server in list(_SERVING):
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and getattr(connection, "client", None) == peer:
                # Without lingering, the kernel would still hold the unsent bytes and keep sending them
                # after close (FIN_WAIT1): a reset drops them and tells the reader at once.
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
                return True
    return False


def write_port_file(path: Path, port: int) -> None:
    """`port` and a newline, in one rename: a reader sees the whole number or no file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(f"{port}\n")
    os.replace(partial, path)


def read_port_file(path: Path) -> int | None:
    """The port a server wrote to `path`, or None while it has written none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    if not text.endswith("\n") or not text.strip().isdigit():
        return None
    return int(text)
