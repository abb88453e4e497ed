"""The answer to one request, built from its engine outputs: one JSON body, or SSE chunks ending in
`data: [DONE]`; with usage, logprobs, and the error of a request that the engine failed or aborted."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from qwen35_jax.serving.engine import RequestOutput, TokenLogprob
from qwen35_jax.serving.errors import APIError
from qwen35_jax.serving.logprobs import LogprobFormatter
from qwen35_jax.serving.prompts import Prepared
from qwen35_jax.serving.submission import Submission

# A streamed chat answer opens with the assistant's role and no text, as OpenAI's does.
FIRST_CHAT_CHOICE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def usage(output: RequestOutput) -> dict:
    return {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": output.num_output_tokens,
            "total_tokens": output.num_prompt_tokens + output.num_output_tokens}  # fmt: skip


def finish_error(output: RequestOutput) -> APIError | None:
    """The error to answer for an output that ends the request without a result, else None."""
    if output.finish_reason == "error":
        return APIError(500, output.error or "the engine failed this request", None, "engine_error")
    if output.finish_reason == "abort":
        return APIError(503, output.error or "the request was cancelled", None, "aborted")
    return None


def texts_per_token(output: RequestOutput) -> list[str]:
    """An output's text, as added by each of its tokens: the engine delivers one token per output, and
    the text of an output is what its last token completed."""
    return [""] * (len(output.logprobs) - 1) + [output.text]


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class Collected:
    """All outputs of one request, for a non-streaming answer."""

    def __init__(self):
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.logprob_texts: list[str] = []  # the text each token of `logprobs` added
        self.last: RequestOutput | None = None

    @classmethod
    async def gather(cls, submission: Submission) -> Collected:
        """Every output until the finish; raises the finish's `APIError` if the request failed."""
        collected = cls()
        async for output in submission.outputs():
            collected.text.append(output.text)
            if output.logprobs:
                collected.logprobs.extend(output.logprobs)
                collected.logprob_texts.extend(texts_per_token(output))
            collected.last = output
        error = finish_error(collected.last)
        if error is not None:
            raise error
        return collected


class ResponseBuilder:
    """The response bodies of one served model, in the OpenAI shapes of protocol.py."""

    def __init__(self, model_name: str, logprobs: LogprobFormatter):
        self.model_name = model_name
        self.logprobs = logprobs

    async def completion(self, submission: Submission) -> dict:
        collected = await Collected.gather(submission)
        logprobs = None
        if submission.prepared.params.logprobs is not None:
            logprobs = self.logprobs.completion(collected.logprobs, collected.logprob_texts, 0)
        choice = {"index": 0, "text": "".join(collected.text), "logprobs": logprobs,
                  "finish_reason": collected.last.finish_reason}  # fmt: skip
        return self._body(submission.prepared, "text_completion", choice, collected.last)

    async def chat(self, submission: Submission) -> dict:
        collected = await Collected.gather(submission)
        logprobs = None
        if submission.prepared.params.logprobs is not None:
            logprobs = self.logprobs.chat(collected.logprobs)
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(collected.text)},
                  "logprobs": logprobs, "finish_reason": collected.last.finish_reason}  # fmt: skip
        return self._body(submission.prepared, "chat.completion", choice, collected.last)

    def _body(self, prepared: Prepared, kind: str, choice: dict, last: RequestOutput) -> dict:
        return {"id": prepared.request_id, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": usage(last)}  # fmt: skip

    async def stream(self, submission: Submission, chat: bool) -> AsyncIterator[str]:
        """SSE chunks of one request; `close` (in finally) aborts it if the client went away first."""
        prepared = submission.prepared
        head = {"id": prepared.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}  # fmt: skip
        usage_field = {"usage": None} if prepared.include_usage else {}
        offset, last = 0, None
        try:
            if chat:
                yield sse(head | {"choices": [FIRST_CHAT_CHOICE]} | usage_field)
            async for output in submission.outputs():
                last = output
                error = finish_error(output)
                if error is not None and output.finish_reason != "abort":
                    yield sse(error.body())
                    break
                # An aborted stream (server shutdown) still ends with a chunk that carries its finish reason.
                # One chunk per token, even when its text is empty (it ends inside a multi-byte character), so
                # that clients can time every token.
                yield sse(head | {"choices": [self._stream_choice(prepared, output, chat, offset)]} | usage_field)
                offset += len(output.text)
            if prepared.include_usage and last is not None and last.finish_reason in ("stop", "length", "abort"):
                yield sse(head | {"choices": [], "usage": usage(last)})
            yield sse("[DONE]")
        except APIError as error:
            yield sse(error.body())
            yield sse("[DONE]")
        finally:
            submission.close()

    def _stream_choice(self, prepared: Prepared, output: RequestOutput, chat: bool, offset: int) -> dict:
        with_logprobs = prepared.params.logprobs is not None and bool(output.logprobs)
        if chat:
            logprobs = self.logprobs.chat(output.logprobs) if with_logprobs else None
            delta = {"content": output.text} if output.text or output.finish_reason is None else {}
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": output.finish_reason}
        logprobs = self.logprobs.completion(output.logprobs, texts_per_token(output), offset) if with_logprobs else None
        return {"index": 0, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
