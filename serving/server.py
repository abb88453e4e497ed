"""The OpenAI-compatible HTTP server: FastAPI routes over one running Engine.

One request's journey, file by file:

1. middleware.py: the gate checks the API key and the body size, before any routing or parsing.
2. protocol.py: pydantic parses the body; strict types, and an unknown field is refused.
3. prompts.py: the checks that need the model (name, vocabulary, context length), then the prompt's token
   ids and the `GenerationParams` (with the grammar of a `response_format`, structured_output.py), as a
   `Prepared`.
4. server.py, `OpenAIServer.submit`: a 429 when the server is full, else `Engine.submit` with a
   `Submission` (submission.py) to receive the outputs.
5. engine.py: the engine thread keeps the request's `Generation` and gives the scheduler its `Request`
   (plan.py); scheduler.py plans every step and runner.py runs it on the device.
6. Each `RequestOutput` crosses from the engine thread to the event loop through the `Submission`;
   responses.py turns them into one JSON body, or SSE chunks ending in `data: [DONE]` (logprobs.py names
   the tokens).

errors.py has the OpenAI error shape: every input problem is a 4xx in it; a 5xx means a bug or a failed
engine. listener.py binds the socket and runs uvicorn. A client that goes away is noticed by its
submission's disconnect watcher, and its request is aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import anyio
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwen35_jax.serving import protocol as api
from qwen35_jax.serving.errors import APIError, error_body, validation_message
from qwen35_jax.serving.listener import UvicornServer, bind, listen_url
from qwen35_jax.serving.logprobs import LogprobFormatter
from qwen35_jax.serving.metrics import CONTENT_TYPE, ServingMetrics
from qwen35_jax.serving.middleware import Gate
from qwen35_jax.serving.prompts import Prepared, RequestPreparer
from qwen35_jax.serving.responses import ResponseBuilder
from qwen35_jax.serving.responses_api import ResponsesAPI, renamed, to_chat
from qwen35_jax.serving.scheduler import RequestRejected
from qwen35_jax.serving.server_config import ServerConfig
from qwen35_jax.serving.submission import OutputRelay, Submission

# `serve` (serving/cli.py) and the tests start a server from this module alone.
__all__ = ["OpenAIServer", "ServerConfig", "UvicornServer", "bind", "create_app", "listen_url"]

log = logging.getLogger(__name__)


class OpenAIServer:
    """One served model: the engine, the request checks and response builders, and the requests in progress."""

    def __init__(self, engine, tokenizer, config: ServerConfig, metrics: ServingMetrics | None = None):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.metrics = metrics or ServingMetrics(config.served_model_name, config.max_model_len, engine)
        self.max_queue = config.max_queue  # an attribute so that it can be changed on a live server
        self.num_active = 0
        self.created = int(time.time())
        self.preparer = RequestPreparer(engine, tokenizer, config)
        self.responses = ResponseBuilder(config.served_model_name, LogprobFormatter(tokenizer))
        self.responses_api = ResponsesAPI(config.served_model_name)
        self._relay: OutputRelay | None = None  # made on the event loop, at the first request

    @property
    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("qwen35-jax")
        except PackageNotFoundError:  # run from a source tree that was never installed
            return "unknown"

    def model_card(self) -> dict:
        """OpenAI's model object with vLLM's additions: root (where the model came from), parent, max_model_len
        and a permission entry."""
        permission = {"id": f"modelperm-{self.config.served_model_name}", "object": "model_permission",
                      "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
        return {"id": self.config.served_model_name, "object": "model", "created": self.created,
                "owned_by": "qwen35-jax", "root": self.config.model_root or self.config.served_model_name,
                "parent": None, "max_model_len": self.config.max_model_len, "permission": [permission]}  # fmt: skip

    def check_room(self, num_choices: int = 1) -> None:
        if self.max_queue is None:
            return
        capacity = self.engine.scheduler.config.max_batch + self.max_queue
        if self.num_active + num_choices > capacity:
            raise APIError(429, f"the server is full: {self.num_active} requests in progress and {num_choices} more "
                                f"asked for (--max-batch + --max-queue = {capacity}); retry later", None,
                           "queue_full")  # fmt: skip

    def submit(self, prepared: Prepared, http_request: HTTPRequest, fork_of: str | None = None) -> Submission:
        """Hands one choice to the engine; the submission counts as in progress until it is closed. fork_of: an
        earlier choice with the same prompt, whose prefill this one shares."""
        if self._relay is None or self._relay.loop is not asyncio.get_running_loop():
            self._relay = OutputRelay(asyncio.get_running_loop())
        submission = Submission(self.engine, prepared, self.metrics.timer(), self._release, self._relay)
        self.num_active += 1
        self.metrics.requests_active.inc()
        try:
            self.engine.submit(prepared.prompt_ids, prepared.params, submission.on_output, prepared.request_id,
                               fork_of=fork_of)  # fmt: skip
        except RequestRejected as err:
            submission.finished = True
            submission.close()
            raise APIError(400, str(err), "max_tokens") from None
        submission.watch(http_request.receive)
        return submission

    def submit_all(self, choices: list[Prepared], http_request: HTTPRequest) -> list[Submission]:
        """Every choice of one answer, or none: a failed submit aborts the ones already in. Choices with the same
        prompt (the `n` samples, or repeated prompts of a batch) share the first one's prefill."""
        self.check_room(len(choices))
        submissions, first_with = [], {}
        try:
            for prepared in choices:
                leader = first_with.setdefault(tuple(prepared.prompt_ids), prepared.request_id)
                fork_of = None if leader == prepared.request_id else leader
                submissions.append(self.submit(prepared, http_request, fork_of))
        except BaseException:
            for submission in submissions:
                submission.close()
            raise
        return submissions

    def _release(self) -> None:
        self.num_active -= 1
        self.metrics.requests_active.dec()

    async def answer(self, choices: list[Prepared], http_request: HTTPRequest, streaming: bool, chat: bool) -> Response:
        submissions = self.submit_all(choices, http_request)
        if streaming:
            return StreamingResponse(self.responses.stream(submissions, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            body = await (self.responses.chat if chat else self.responses.completion)(submissions)
        finally:
            for submission in submissions:
                submission.close()
        return JSONResponse(body)

    async def respond(self, request: api.ResponsesRequest, http_request: HTTPRequest) -> Response:
        """A Responses API request, answered through the chat path (responses_api.py)."""
        try:
            chat, conversation = to_chat(request, self.responses_api.store)
            (choice,) = await self.preparer.chat(chat)
        except APIError as error:
            raise renamed(error) from None
        choice = dataclasses.replace(choice, response_id="resp_" + choice.request_id.removeprefix("chatcmpl-"))
        (submission,) = self.submit_all([choice], http_request)
        if request.stream:
            return StreamingResponse(self.responses_api.stream(request, submission, conversation),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            body = await self.responses_api.answer(request, submission, conversation)
        finally:
            submission.close()
        return JSONResponse(body)

    def error_response(self, status: int, message: str, param: str | None = None, code: str | None = None):
        self.metrics.http_errors.labels(status=str(status)).inc()
        return JSONResponse(error_body(status, message, param, code), status_code=status)


ERROR_RESPONSES = {status: {"model": api.ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}


@contextlib.asynccontextmanager
async def _startup(_: FastAPI):
    """Before the socket accepts connections: load anyio's asyncio backend, which Starlette's streamed responses
    import at their first use. On a fresh server that import ran on the event loop inside the first streamed
    request, and the other requests of a first burst reached the engine only after it (a py-spy profile of a fresh
    tiny server's first 16-prompt burst found the event loop in that import)."""
    await anyio.sleep(0)
    yield


def create_app(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="qwen35-jax", summary="OpenAI-compatible server for Qwen3.5 in JAX", version="0.1.0",
                  lifespan=_startup)  # fmt: skip
    _add_error_handlers(app, server)
    _add_routes(app, server)
    app.add_middleware(Gate, config=server.config, metrics=server.metrics)
    config = server.config
    # Added last, so it is outermost: a browser's preflight (OPTIONS, no API key) is answered before the gate.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)  # fmt: skip
    return app


def _add_error_handlers(app: FastAPI, server: OpenAIServer) -> None:
    """Every error leaves in the OpenAI shape, counted by status."""

    @app.exception_handler(APIError)
    async def on_api_error(_: HTTPRequest, error: APIError):
        return server.error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: HTTPRequest, error: RequestValidationError):
        message, param = validation_message(list(error.errors()) or [{"msg": "invalid request"}])
        return server.error_response(400, message, param, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: HTTPRequest, error: StarletteHTTPException):
        return server.error_response(error.status_code, f"{error.detail}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def on_unexpected(_: HTTPRequest, error: Exception):
        log.exception("unexpected error")
        return server.error_response(500, f"internal error: {type(error).__name__}", None, "internal_error")


def _add_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.get("/health")
    async def health() -> Response:
        if not server.engine.is_running():
            return server.error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    # vLLM's liveness route for SageMaker-style hosts, which probe it with either method (a route each, so that
    # each has its own OpenAPI operation id).
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=api.ModelList, responses=ERROR_RESPONSES)
    async def models():
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{model_id:path}", response_model=api.ModelCard, responses=ERROR_RESPONSES)
    async def model(model_id: str):
        server.preparer.check_model(model_id)
        return JSONResponse(server.model_card())

    @app.get("/version")
    async def version():
        return JSONResponse({"version": server.version})

    @app.post("/tokenize", response_model=api.TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: api.TokenizeCompletionRequest | api.TokenizeChatRequest):
        return JSONResponse(await server.preparer.tokenize(body))

    @app.post("/detokenize", response_model=api.DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: api.DetokenizeRequest):
        return JSONResponse(await server.preparer.detokenize(body))

    @app.post("/v1/completions", response_model=api.CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: api.CompletionRequest, request: HTTPRequest):
        prepared = await server.preparer.completion(body)
        return await server.answer(prepared, request, body.stream, chat=False)

    @app.post("/v1/chat/completions", response_model=api.ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: api.ChatCompletionRequest, request: HTTPRequest):
        prepared = await server.preparer.chat(body)
        return await server.answer(prepared, request, body.stream, chat=True)

    @app.post("/v1/responses", responses=ERROR_RESPONSES)
    async def create_response(body: api.ResponsesRequest, request: HTTPRequest):
        return await server.respond(body, request)

    @app.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def retrieve_response(response_id: str):
        return JSONResponse(server.responses_api.store.body(response_id))

    @app.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete_response(response_id: str):
        server.responses_api.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
