"""One request inside the engine, seen from the event loop: outputs cross from the engine thread to the
loop, a client that goes away aborts its request, and `close` releases it whichever way it ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from qwen35_jax.serving.engine import RequestOutput
from qwen35_jax.serving.errors import APIError
from qwen35_jax.serving.metrics import RequestTimer
from qwen35_jax.serving.prompts import Prepared

# How often a request waiting for output checks that the engine thread is still alive.
ENGINE_CHECK_SECONDS = 5.0


class OutputRelay:
    """Carries outputs from the engine thread to one event loop's queues, waking the loop once for all the outputs
    that arrive before it runs, rather than once per output: each wake-up is a write to the loop's self-pipe (a
    system call, dear under gVisor), and a step of B requests delivers B outputs at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, RequestOutput]] = []

    def put(self, queue: asyncio.Queue, output: RequestOutput) -> None:
        """Runs on the engine thread."""
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:  # a drain is already on its way
                return
        if self.loop.is_closed():  # the server has stopped and nobody is listening
            with self._lock:
                self._pending.clear()
            return
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, output in batch:
            queue.put_nowait(output)


class Submission:
    """The HTTP side's handle on one submitted request; created by `OpenAIServer.submit`, one per request.

    The engine keeps its own state of the request (`Generation`, and the scheduler's `Request`); this
    object only bridges threads. `on_output` runs on the engine thread and queues each `RequestOutput` on
    the event loop (through the loop's `OutputRelay`), where `outputs()` yields them until the finish. A task waits for the client's
    `http.disconnect` and then closes the submission, which aborts the request at once, so the engine
    frees its slot and pages before its next step. `close` also hands the server's capacity back
    (`release`).
    """

    def __init__(self, engine, prepared: Prepared, timer: RequestTimer, release: Callable[[], None],
                 relay: OutputRelay):  # fmt: skip
        self.engine = engine
        self.prepared = prepared
        self.timer = timer
        self.release = release
        self.relay = relay
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        self.closed = False
        self.watcher: asyncio.Task | None = None

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    def on_output(self, output: RequestOutput) -> None:
        """Runs on the engine thread."""
        self.timer.record(output)
        self.relay.put(self.queue, output)

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
