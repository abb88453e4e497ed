"""The ASGI gate in front of the app: the API key (for /v1/ routes) and the body-size limit, checked before
any routing or parsing, so that an unauthorized or oversized request costs no JSON parse.

The body is read here in full (that is how its size is known) and replayed to the app; after the replay,
`receive` goes to the connection again, so the route can still see the client's `http.disconnect`.
"""

from __future__ import annotations

import json
import logging
import secrets

from qwen35_jax.serving.errors import error_body
from qwen35_jax.serving.metrics import ServingMetrics
from qwen35_jax.serving.server_config import ServerConfig

log = logging.getLogger(__name__)


class Gate:
    """ASGI middleware: a 401 for a missing or wrong key, a 413 for a body over `max_body_bytes`, and a 500 in the
    error shape for whatever the app raises before it answers."""

    DRAIN_LIMIT = 64 << 20  # a too-large body up to this size is read and dropped so the client sees the 413

    def __init__(self, app, config: ServerConfig, metrics: ServingMetrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = self.config.api_key
        if key is not None and scope["path"].startswith("/v1/") and not _authorized(headers, key):
            return await self._reply(send, 401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     "invalid_api_key")  # fmt: skip
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit():
            return await self._reply(send, 400, "bad Content-Length header", "bad_request")
        size = int(declared)
        if size <= self.DRAIN_LIMIT:
            body, size = await _read_body(receive, limit, self.DRAIN_LIMIT)
            if body is None:
                return  # the client went away
        if size > limit:
            return await self._reply(send, 413, f"request body of {size}+ bytes exceeds the limit of {limit} bytes",
                                     "request_too_large")  # fmt: skip
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _replay(body, receive), tracked_send)
        except Exception as error:
            # Answered here rather than re-raised: Starlette's last-resort handler re-raises after its 500, and the
            # server then drops the connection, so a client's next request on it (keep-alive) failed too.
            log.exception("unexpected error")
            if not started:
                await self._reply(send, 500, f"internal error: {type(error).__name__}", "internal_error")

    async def _reply(self, send, status: int, message: str, code: str) -> None:
        self.metrics.http_errors.labels(status=str(status)).inc()
        payload = json.dumps(error_body(status, message, None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive, limit: int, drain_limit: int) -> tuple[bytes | None, int]:
    """The body if it fits in `limit`, and its size; past the limit it is read and dropped, up to `drain_limit`."""
    parts, size, more = [], 0, True
    while more and size <= drain_limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, size
        chunk = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size <= limit:
            parts.append(chunk)
    return b"".join(parts), size


def _authorized(headers: dict[bytes, bytes], key: str) -> bool:
    given = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())


def _replay(body: bytes, receive):
    """A receive() that hands out the already-read body once, then defers to the connection (for disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
