"""Where the server listens: the socket, bound before the model loads, and uvicorn serving the app on it."""

from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a taken port fails in milliseconds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class UvicornServer(uvicorn.Server):
    """uvicorn, quiet, calling `on_started` once the socket accepts connections."""

    def __init__(self, app, on_started: Callable[[], None] | None = None, **config):
        config = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": 5} | config
        super().__init__(uvicorn.Config(app, **config))
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()
