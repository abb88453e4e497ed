"""The OpenAI-compatible HTTP server: FastAPI routes over one running Engine.

A request's journey: the gate (API key, body size) -> pydantic validation (protocol.py) -> checks that need
the model (name, vocabulary, context length, queue room) -> `engine.submit` -> outputs arrive on the engine
thread and are handed to the event loop through an asyncio.Queue -> one JSON body, or SSE chunks ending in
`data: [DONE]`.

Every input problem is answered with a 4xx in the OpenAI error shape; a 5xx means a bug or a failed engine.
A client that goes away is noticed by a task that waits for its `http.disconnect`, and its request is
aborted at once, so the engine frees the slot and pages before its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwen35_jax.sampling import SamplingParams
from qwen35_jax.serving import protocol as api
from qwen35_jax.serving.engine import GenerationParams, RequestOutput, TokenLogprob
from qwen35_jax.serving.errors import APIError, error_body, validation_message
from qwen35_jax.serving.listener import UvicornServer, bind, listen_url
from qwen35_jax.serving.metrics import CONTENT_TYPE, ServingMetrics
from qwen35_jax.serving.middleware import Gate
from qwen35_jax.serving.scheduler import RequestRejected
from qwen35_jax.serving.server_config import ServerConfig

# `serve` (serving/cli.py) and the tests start a server from this module alone.
__all__ = ["OpenAIServer", "ServerConfig", "UvicornServer", "bind", "create_app", "listen_url"]

log = logging.getLogger(__name__)

# How often a request waiting for output checks that the engine thread is still alive.
ENGINE_CHECK_SECONDS = 5.0


def _random_seed() -> int:
    return secrets.randbits(32)


# ---- one request inside the engine, seen from the event loop ---------------------------------------------


class Submission:
    """Bridges one engine request to the event loop; `close` releases it whichever way it ends."""

    def __init__(self, server: OpenAIServer, request_id: str):
        self.server = server
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.timer = server.metrics.timer()
        self.finished = False
        self.closed = False
        self.watcher: asyncio.Task | None = None

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
                if not self.server.engine.is_running():
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
            self.server.engine.abort(self.request_id)
        if self.watcher is not None and self.watcher is not asyncio.current_task():
            self.watcher.cancel()
        self.server.num_active -= 1
        self.server.metrics.requests_active.dec()


@dataclasses.dataclass
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    include_usage: bool


# ---- the server ------------------------------------------------------------------------------------------


class OpenAIServer:
    def __init__(self, engine, tokenizer, config: ServerConfig, metrics: ServingMetrics | None = None):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.metrics = metrics or ServingMetrics(engine)
        self.max_queue = config.max_queue  # an attribute so that it can be changed on a live server
        self.num_active = 0
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None

    # ---- checks ------------------------------------------------------------------------------------------
    def check_request(self, request: api.SamplingFields) -> None:
        if request.model != self.config.served_model_name:
            raise APIError(404, f"model {request.model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", "model", "model_not_found")  # fmt: skip
        problems = api.unsupported_params(request)
        if problems:
            param, message = problems[0]
            raise APIError(400, message, param, "unsupported_parameter")
        if not self.engine.is_running():
            raise APIError(503, "the engine is not running")

    def check_prompt(self, ids: list[int], param: str) -> None:
        vocab = self.config.vocab_size
        if not ids:
            raise APIError(400, "the prompt is empty: at least one prompt token is needed", param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param)
        if len(ids) >= self.config.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens, but --max-model-len is "
                                f"{self.config.max_model_len}: the prompt and at least one output token must "
                                f"fit", param, "context_length_exceeded")  # fmt: skip

    def check_room(self) -> None:
        if self.max_queue is None:
            return
        capacity = self.engine.scheduler.config.max_batch + self.max_queue
        if self.num_active >= capacity:
            raise APIError(429, f"the server is full: {self.num_active} requests in progress (--max-batch + "
                                f"--max-queue = {capacity}); retry later", None, "queue_full")  # fmt: skip

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"model {self.config.served_model_name!r} has no tokenizer: send the prompt as a "
                                "list of token ids to /v1/completions", param)  # fmt: skip

    # ---- prompts -----------------------------------------------------------------------------------------
    async def completion_prompt(self, request: api.CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            ids = list(prompt)
        else:
            self._need_tokenizer("prompt")
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        self.check_prompt(ids, "prompt")
        return ids

    async def chat_prompt(self, request: api.ChatCompletionRequest) -> list[int]:
        self._need_tokenizer("messages")
        messages = [m.for_template() for m in request.messages]
        kwargs = request.chat_template_kwargs or {}
        reserved = {"messages", "add_generation_prompt", "tools"} & kwargs.keys()
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
        try:
            ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages, True, **kwargs)
        except Exception as err:  # the template runs on client data: whatever it raises is the client's
            raise APIError(400, f"messages: {err}", "messages") from None
        self.check_prompt(ids, "messages")
        return ids

    # ---- parameters --------------------------------------------------------------------------------------
    def generation_params(self, request: api.SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                          default_max_tokens: int, logprobs: int | None) -> GenerationParams:  # fmt: skip
        room = self.config.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        try:
            self.engine.check(num_prompt_tokens, max_tokens)
        except RequestRejected as err:
            raise APIError(400, str(err), "max_tokens", "context_length_exceeded") from None
        if logprobs is not None and logprobs > self.config.max_logprobs:
            raise APIError(400, f"at most {self.config.max_logprobs} logprobs per token, got {logprobs}", "logprobs")
        bad = [t for t in request.stop_token_ids or () if t >= self.config.vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary [0, "
                                f"{self.config.vocab_size})", "stop_token_ids")  # fmt: skip
        top_k = request.top_k or 0
        sampling = SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=0 if top_k < 0 or top_k >= self.config.vocab_size else top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            min_p=request.min_p or 0.0,
            seed=_random_seed() if request.seed is None else request.seed % 2**32,
        )  # fmt: skip
        return GenerationParams(
            max_tokens=max_tokens, sampling=sampling, stop=request.stop_strings(),
            stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos, logprobs=logprobs,
        )  # fmt: skip

    async def prepare_completion(self, request: api.CompletionRequest) -> Prepared:
        self.check_request(request)
        ids = await self.completion_prompt(request)
        params = self.generation_params(request, len(ids), request.max_tokens,
                                        self.config.default_completion_max_tokens, request.logprobs)  # fmt: skip
        return Prepared(f"cmpl-{uuid.uuid4().hex}", ids, params, _include_usage(request))

    async def prepare_chat(self, request: api.ChatCompletionRequest) -> Prepared:
        self.check_request(request)
        ids = await self.chat_prompt(request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.generation_params(request, len(ids), max_tokens, self.config.default_chat_max_tokens, logprobs)
        return Prepared(f"chatcmpl-{uuid.uuid4().hex}", ids, params, _include_usage(request))

    # ---- submission --------------------------------------------------------------------------------------
    def submit(self, prepared: Prepared, http_request: Request) -> Submission:
        self.check_room()
        submission = Submission(self, prepared.request_id)
        self.num_active += 1
        self.metrics.requests_active.inc()
        try:
            self.engine.submit(prepared.prompt_ids, prepared.params, submission.on_output, prepared.request_id)
        except RequestRejected as err:
            submission.finished = True
            submission.close()
            raise APIError(400, str(err), "max_tokens") from None
        self.metrics.prompt_tokens.inc(len(prepared.prompt_ids))
        submission.watch(http_request.receive)
        return submission

    # ---- logprobs ----------------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> list[int] | None:
        if self.tokenizer is None:
            return None
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return []
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or `bytes:\\xNN..` for part of a multi-byte character (as
        OpenAI does), which keeps such tokens apart in a top_logprobs dict."""
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                raw = bytes(self.token_bytes(token_id))
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            if len(self._token_text) < 1 << 20:
                self._token_text[token_id] = text
        return text

    def completion_logprobs(self, entries: list[TokenLogprob], texts: list[str], offset: int) -> dict:
        """`texts[i]`: the text that token i added to the output, for `text_offset`."""
        tokens, chosen, tops, offsets = [], [], [], []
        for entry, text in zip(entries, texts, strict=True):
            tokens.append(self.token_text(entry.token_id))
            chosen.append(api.finite_logprob(entry.logprob))
            top: dict[str, float] = {}
            for token_id, logprob in entry.top:  # most likely first: a name shared by two tokens keeps the higher
                top.setdefault(self.token_text(token_id), api.finite_logprob(logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": api.finite_logprob(logprob),
                    "bytes": self.token_bytes(token_id)}  # fmt: skip

        content = [one(e.token_id, e.logprob) | {"top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]
        return {"content": content}


def _include_usage(request: api.SamplingFields) -> bool:
    return request.stream_options is not None and request.stream_options.include_usage


def _usage(output: RequestOutput) -> dict:
    return {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": output.num_output_tokens,
            "total_tokens": output.num_prompt_tokens + output.num_output_tokens}  # fmt: skip


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def _byte_decoder() -> dict[str, int]:
    """Character -> byte of byte-level BPE, which shows every byte as a printable character: printable
    Latin-1 bytes stand for themselves, the other bytes are shifted to code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


# ---- responses -------------------------------------------------------------------------------------------


def _texts_per_token(output: RequestOutput) -> list[str]:
    """An output's text, as added by each of its tokens: the engine delivers one token per output, and
    the text of an output is what its last token completed."""
    return [""] * (len(output.logprobs) - 1) + [output.text]


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _finish_error(output: RequestOutput) -> APIError | None:
    if output.finish_reason == "error":
        return APIError(500, output.error or "the engine failed this request", None, "engine_error")
    if output.finish_reason == "abort":
        return APIError(503, output.error or "the request was cancelled", None, "aborted")
    return None


class Collected:
    """All outputs of one request, for a non-streaming answer."""

    def __init__(self):
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.logprob_texts: list[str] = []  # the text each token of `logprobs` added
        self.last: RequestOutput | None = None

    @classmethod
    async def gather(cls, submission: Submission) -> Collected:
        collected = cls()
        async for output in submission.outputs():
            collected.text.append(output.text)
            if output.logprobs:
                collected.logprobs.extend(output.logprobs)
                collected.logprob_texts.extend(_texts_per_token(output))
            collected.last = output
        error = _finish_error(collected.last)
        if error is not None:
            raise error
        return collected


async def complete(server: OpenAIServer, prepared: Prepared, submission: Submission) -> dict:
    collected = await Collected.gather(submission)
    logprobs = None
    if prepared.params.logprobs is not None:
        logprobs = server.completion_logprobs(collected.logprobs, collected.logprob_texts, 0)
    choice = {"index": 0, "text": "".join(collected.text), "logprobs": logprobs,
              "finish_reason": collected.last.finish_reason}  # fmt: skip
    return {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
            "model": server.config.served_model_name, "choices": [choice], "usage": _usage(collected.last)}  # fmt: skip


async def chat_complete(server: OpenAIServer, prepared: Prepared, submission: Submission) -> dict:
    collected = await Collected.gather(submission)
    logprobs = server.chat_logprobs(collected.logprobs) if prepared.params.logprobs is not None else None
    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(collected.text)},
              "logprobs": logprobs, "finish_reason": collected.last.finish_reason}  # fmt: skip
    return {"id": prepared.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": server.config.served_model_name, "choices": [choice], "usage": _usage(collected.last)}  # fmt: skip


def _stream_choice(server: OpenAIServer, prepared: Prepared, output: RequestOutput, chat: bool, offset: int) -> dict:
    with_logprobs = prepared.params.logprobs is not None and bool(output.logprobs)
    if chat:
        logprobs = server.chat_logprobs(output.logprobs) if with_logprobs else None
        delta = {"content": output.text} if output.text or output.finish_reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": output.finish_reason}
    logprobs = server.completion_logprobs(output.logprobs, _texts_per_token(output), offset) if with_logprobs else None
    return {"index": 0, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}


async def stream(server: OpenAIServer, prepared: Prepared, submission: Submission, chat: bool) -> AsyncIterator[str]:
    """SSE chunks of one request; `close` (in finally) aborts it if the client went away first."""
    head = {"id": prepared.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": server.config.served_model_name}  # fmt: skip
    usage_field = {"usage": None} if prepared.include_usage else {}
    offset = 0
    try:
        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _sse(head | {"choices": [first]} | usage_field)
        last = None
        async for output in submission.outputs():
            last = output
            error = _finish_error(output)
            if error is not None:
                yield _sse(error_body(error.status, error.message, error.param, error.code))
                break
            # One chunk per token, even when its text is empty (it ends inside a multi-byte character), so
            # that clients can time every token.
            yield _sse(head | {"choices": [_stream_choice(server, prepared, output, chat, offset)]} | usage_field)
            offset += len(output.text)
        if prepared.include_usage and last is not None and last.finish_reason in ("stop", "length"):
            yield _sse(head | {"choices": [], "usage": _usage(last)})
        yield _sse("[DONE]")
    except APIError as error:
        yield _sse(error_body(error.status, error.message, error.param, error.code))
        yield _sse("[DONE]")
    finally:
        submission.close()


# ---- the app ---------------------------------------------------------------------------------------------


ERROR_RESPONSES = {status: {"model": api.ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}


def create_app(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="qwen35-jax", summary="OpenAI-compatible server for Qwen3.5 in JAX", version="0.1.0")

    def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        server.metrics.http_errors.labels(status=str(status)).inc()
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError):
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError):
        message, param = validation_message(list(error.errors()) or [{"msg": "invalid request"}])
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException):
        return error_response(error.status_code, f"{error.detail}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, error: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {type(error).__name__}", None, "internal_error")

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.is_running():
            return error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=api.ModelList, responses=ERROR_RESPONSES)
    async def models():
        card = {"id": server.config.served_model_name, "object": "model", "created": server.created,
                "owned_by": "qwen35-jax", "max_model_len": server.config.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions", response_model=api.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: api.CompletionRequest, request: Request):
        prepared = await server.prepare_completion(body)
        return await _answer(server, prepared, request, body.stream, chat=False)

    @app.post("/v1/chat/completions", response_model=api.ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        prepared = await server.prepare_chat(body)
        return await _answer(server, prepared, request, body.stream, chat=True)

    app.add_middleware(Gate, config=server.config, metrics=server.metrics)
    return app


async def _answer(server: OpenAIServer, prepared: Prepared, request: Request, streaming: bool, chat: bool):
    submission = server.submit(prepared, request)
    if streaming:
        return StreamingResponse(stream(server, prepared, submission, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip
    try:
        body = await (chat_complete if chat else complete)(server, prepared, submission)
    finally:
        submission.close()
    return JSONResponse(body)
