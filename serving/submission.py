"""One request inside the engine, seen from the event loop: outputs cross from the engine thread to the
loop, a client that goes away aborts its request, and `close` releases it whichever way it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from qwen35_jax.serving.engine import RequestOutput
from qwen35_jax.serving.errors import APIError
from qwen35_jax.serving.metrics import RequestTimer
from qwen35_jax.serving.prompts import Prepared

# How often a request waiting for output checks that the engine thread is still alive.
ENGINE_CHECK_SECONDS = 5.0


class Submission:
    """The HTTP side's handle on one submitted request; created by `OpenAIServer.submit`, one per request.

    The engine keeps its own state of the request (`Generation`, and the scheduler's `Request`); this
    object only bridges threads. `on_output` runs on the engine thread and queues each `RequestOutput` on
    the event loop, where `outputs()` yields them until the finish. A task waits for the client's
    `http.disconnect` and then closes the submission, which aborts the request at once, so the engine
    frees its slot and pages before its next step. `close` also hands the server's capacity back
    (`release`).
    """

    def __init__(self, engine, prepared: Prepared, timer: RequestTimer, release: Callable[[], None]):
        self.engine = engine
        self.prepared = prepared
        self.timer = timer
        self.release = release
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        self.closed = False
        self.watcher: asyncio.Task | None = None

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    def on_output(self, output: RequestOutput) -> None:
        """Runs on the engine thread."""
        self.timer.record(len(output.token_ids), output.finish_reason)
        if not self.loop.is_closed():  # closed: the server has stopped and nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            output = await self._next()
            self.finished = output.finish_reason is not None
            yield output

    async def _next(self) -> RequestOutput:
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), ENGINE_CHECK_SECONDS)
            except TimeoutError:
                if not self.engine.is_running():
                    raise APIError(503, "the engine has stopped") from None

    def watch(self, receive: Callable) -> None:
        self.watcher = asyncio.create_task(self._abort_on_disconnect(receive))

    async def _abort_on_disconnect(self, receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.close()  # aborts the request; also covers a stream whose body never started

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.engine.abort(self.request_id)
        if self.watcher is not None and self.watcher is not asyncio.current_task():
            self.watcher.cancel()
        self.release()
