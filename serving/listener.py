"""Where the server listens: the socket, bound before the model loads, and uvicorn serving the app on it."""

from __future__ import annotations

import socket
import threading
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
    """uvicorn, quiet, calling `on_started` once the socket accepts connections.

    On shutdown (SIGTERM, SIGINT) it stops accepting connections at once and lets requests in flight run on for
    `drain_seconds`; then it calls `on_drain_timeout` (the engine's shutdown, which ends every request with
    finish_reason "abort"), so that each stream still gets its last chunk and `[DONE]` before the process exits.
    """

    # After the drain, the seconds uvicorn waits for the connections to write their last chunks.
    FINAL_WRITE_SECONDS = 5.0

    def __init__(self, app, on_started: Callable[[], None] | None = None, drain_seconds: float = 0.0,
                 on_drain_timeout: Callable[[], None] | None = None, **config):  # fmt: skip
        timeout = drain_seconds + self.FINAL_WRITE_SECONDS
        config = {"log_level": "warning", "access_log": False, "timeout_graceful_shutdown": timeout} | config
        super().__init__(uvicorn.Config(app, **config))
        self.on_started = on_started
        self.drain_seconds = drain_seconds
        self.on_drain_timeout = on_drain_timeout

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        # A thread, not a task: the engine's shutdown joins the engine thread.
        timer = None
        if self.on_drain_timeout is not None:
            timer = threading.Timer(self.drain_seconds, self.on_drain_timeout)
            timer.daemon = True
            timer.start()
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
