"""The answer to one request, built from the engine outputs of its choices: one JSON body, or SSE chunks ending
in `data: [DONE]`; with usage, logprobs, and the error of a request that the engine failed or aborted."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from qwen35_jax.serving.engine import RequestOutput, TokenLogprob
from qwen35_jax.serving.errors import APIError
from qwen35_jax.serving.logprobs import LogprobFormatter, joined
from qwen35_jax.serving.parsers import OutputParser
from qwen35_jax.serving.prompts import EchoedPrompt, Prepared
from qwen35_jax.serving.submission import Submission

# A streamed chat answer opens with the assistant's role and no text, as OpenAI's does.
FIRST_CHAT_CHOICE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def finish_error(output: RequestOutput) -> APIError | None:
    """The error to answer for an output that ends the request without a result, else None."""
    if output.finish_reason == "error" and output.error_param is not None:
        return APIError(400, output.error, output.error_param, "invalid_request_error")
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
        self.prompt_logprobs: list[TokenLogprob] = []
        self.token_ids: list[int] = []
        self.last: RequestOutput | None = None

    @classmethod
    async def gather(cls, submission: Submission) -> Collected:
        """Every output until the finish; raises the finish's `APIError` if the request failed."""
        collected = cls()
        async for output in submission.outputs():
            collected.text.append(output.text)
            collected.token_ids.extend(output.token_ids)
            if output.logprobs:
                collected.logprobs.extend(output.logprobs)
                collected.logprob_texts.extend(texts_per_token(output))
            collected.prompt_logprobs.extend(output.prompt_logprobs or ())
            collected.last = output
        error = finish_error(collected.last)
        if error is not None:
            raise error
        return collected


def usage(choices: list[tuple[Prepared, RequestOutput]]) -> dict:
    """The answer's usage: each prompt's tokens once (not once per sample), and every choice's output tokens."""
    prompt = sum(last.num_prompt_tokens for prepared, last in choices if prepared.sample == 0)
    completion = sum(last.num_output_tokens for _, last in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseBuilder:
    """The response bodies of one served model, in the OpenAI shapes of protocol.py. An answer has one choice per
    submission (each prompt of a batch, n times), in the order of their indices."""

    def __init__(self, model_name: str, logprobs: LogprobFormatter):
        self.model_name = model_name
        self.logprobs = logprobs
        self._logprobs_as_ids = LogprobFormatter(logprobs.tokenizer, names_as_ids=True)

    def _formatter(self, prepared: Prepared) -> LogprobFormatter:
        return self._logprobs_as_ids if prepared.token_names_as_ids else self.logprobs

    async def completion(self, submissions: list[Submission]) -> dict:
        return await self._answer(submissions, "text_completion", self._completion_choice)

    async def chat(self, submissions: list[Submission]) -> dict:
        return await self._answer(submissions, "chat.completion", self._chat_choice)

    async def _answer(self, submissions: list[Submission], kind: str, build_choice) -> dict:
        gathered = await asyncio.gather(*(Collected.gather(s) for s in submissions))
        choices = [build_choice(s.prepared, collected) for s, collected in zip(submissions, gathered, strict=True)]
        finished = [(s.prepared, collected.last) for s, collected in zip(submissions, gathered, strict=True)]
        first = submissions[0].prepared
        answer = {"id": first.response_id, "object": kind, "created": int(time.time()), "model": self.model_name,
                  "choices": choices, "usage": usage(finished)}  # fmt: skip
        if kind == "chat.completion":  # chat has one prompt, so its prompt's fields are the answer's (as vLLM's)
            answer |= self._chat_prompt_fields(first, gathered[0].prompt_logprobs or None)
        return answer

    def _chat_prompt_fields(self, prepared: Prepared, prompt_logprobs: list[TokenLogprob] | None) -> dict:
        """A chat answer's vLLM prompt fields: prompt_token_ids (return_token_ids) and prompt_logprobs."""
        fields = {"prompt_token_ids": prepared.prompt_ids} if prepared.return_token_ids else {}
        return fields | self._prompt_logprobs_field(prepared, prompt_logprobs)

    def _prompt_logprobs_field(self, prepared: Prepared, prompt_logprobs: list[TokenLogprob] | None) -> dict:
        if prepared.prompt_logprobs is None or prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self._formatter(prepared).prompt_logprobs(prompt_logprobs, prepared.prompt_logprobs)}

    def _completion_choice(self, prepared: Prepared, collected: Collected) -> dict:
        output = RequestOutput(prepared.request_id, [], "".join(collected.text), collected.logprobs,
                               collected.last.finish_reason, prompt_logprobs=collected.prompt_logprobs,
                               stop_reason=collected.last.stop_reason)  # fmt: skip
        choice = self._completion_text(prepared, output, collected.logprob_texts, 0, prepared.echo)
        if prepared.return_token_ids:
            choice |= {"prompt_token_ids": prepared.prompt_ids, "token_ids": collected.token_ids}
        return choice

    def _completion_text(self, prepared: Prepared, output: RequestOutput, texts: list[str], offset: int,
                         echo: EchoedPrompt | None) -> dict:  # fmt: skip
        """A completions choice of `output`, whose tokens added `texts`, at `offset` in the answer's text; led by the
        echoed prompt (its text, and with logprobs its tokens') when `echo` is given."""
        logprobs, formatter = None, self._formatter(prepared)
        start = offset + (len(echo.text) if echo is not None else 0)
        if prepared.params.logprobs is not None and (output.logprobs or echo is not None):
            logprobs = formatter.completion(output.logprobs or [], texts, start)
            if echo is not None:
                prompt = formatter.echoed_prompt(prepared.prompt_ids, output.prompt_logprobs or [],
                                                     echo.token_texts, prepared.params.logprobs)  # fmt: skip
                logprobs = joined(prompt, logprobs)
        # vLLM's stop_reason is on every completions choice, streamed ones too (null until the finish).
        choice = {"index": prepared.index, "text": (echo.text if echo is not None else "") + output.text,
                  "logprobs": logprobs, "finish_reason": output.finish_reason,
                  "stop_reason": output.stop_reason}  # fmt: skip
        if prepared.prompt_logprobs is not None and output.prompt_logprobs is not None:
            choice["prompt_logprobs"] = formatter.prompt_logprobs(output.prompt_logprobs, prepared.prompt_logprobs)
        return choice

    def _chat_choice(self, prepared: Prepared, collected: Collected) -> dict:
        logprobs = None
        if prepared.params.logprobs is not None:
            logprobs = self._formatter(prepared).chat(collected.logprobs)
        text = "".join(collected.text)
        message, calls = {"role": "assistant", "content": text}, []
        if prepared.output_format is not None:
            parser = prepared.output_format.parser()
            parsed = parser.push(text)
            parsed += parser.finish()
            calls = parsed.tool_calls
            message["content"] = (parsed.content.strip() or None) if calls else parsed.content
            if parsed.reasoning and prepared.include_reasoning:
                message["reasoning_content"] = parsed.reasoning.strip("\n")
            if calls:
                message["tool_calls"] = [call.as_dict() for call in calls]
        if prepared.echo is not None:
            message["content"] = prepared.echo.text + (message["content"] or "")
        choice = {"index": prepared.index, "message": message, "logprobs": logprobs,
                  "finish_reason": _finish_reason(collected.last.finish_reason, bool(calls)),
                  "stop_reason": collected.last.stop_reason}  # fmt: skip
        if prepared.return_token_ids:
            choice["token_ids"] = collected.token_ids
        return choice

    async def stream(self, submissions: list[Submission], chat: bool) -> AsyncIterator[str]:
        """SSE chunks of every choice, as each choice's outputs come, then the usage chunk if asked and
        `[DONE]`. `close` (in finally) aborts the choices still running if the client went away first."""
        first = submissions[0].prepared
        head = {"id": first.response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}  # fmt: skip
        usage_field = {"usage": None} if first.include_usage else {}
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._choice_chunks(s, chat, queue)) for s in submissions]
        finished, failed = [], None
        try:
            while len(finished) < len(submissions) and failed is None:
                kind, item = await queue.get()
                if kind == "chunk":
                    choice, fields = item
                    yield sse(head | {"choices": [choice]} | usage_field | fields)
                elif kind == "error":
                    failed = item
                else:
                    finished.append(item)
            if failed is not None:
                yield sse(failed.body())
            elif first.include_usage and all(last.finish_reason in ("stop", "length", "abort") for _, last in finished):
                yield sse(head | {"choices": [], "usage": usage(finished)})
            yield sse("[DONE]")
        finally:
            for task in tasks:
                task.cancel()
            for submission in submissions:
                submission.close()

    async def _choice_chunks(self, submission: Submission, chat: bool, queue: asyncio.Queue) -> None:
        """One choice's chunks onto `queue`: ("chunk", (choice, the chunk's other top-level fields)), then ("done",
        (prepared, last output)), or ("error", APIError) for a choice the engine failed."""
        prepared = submission.prepared
        offset, last, echo = 0, None, prepared.echo  # the first chunk echoes the prompt, as vLLM's does
        parser = prepared.output_format.parser() if chat and prepared.output_format is not None else None
        generated, first_output = 0, True

        def so_far() -> dict:
            if not prepared.continuous_usage:
                return {}
            prompt = len(prepared.prompt_ids)
            return {"usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                              "total_tokens": prompt + generated}}  # fmt: skip

        try:
            if chat:  # the role chunk, which leads with the echoed last message and carries the prompt's ids
                first = FIRST_CHAT_CHOICE | {"index": prepared.index}
                if echo is not None:
                    first["delta"] = first["delta"] | {"content": echo.text}
                    echo = None
                fields = {"prompt_token_ids": prepared.prompt_ids} if prepared.return_token_ids else {}
                queue.put_nowait(("chunk", (first, so_far() | fields)))
            async for output in submission.outputs():
                last = output
                error = finish_error(output)
                if error is not None and output.finish_reason != "abort":
                    raise error
                # An aborted stream (server shutdown) still ends with a chunk that carries its finish reason.
                # One chunk per token, even when its text is empty (it ends inside a multi-byte character), so
                # that clients can time every token.
                generated += len(output.token_ids)
                chunk = self._stream_choice(prepared, output, chat, offset, parser, echo)
                fields = so_far()
                if prepared.return_token_ids:
                    chunk["token_ids"] = output.token_ids
                    if not chat and first_output:
                        chunk["prompt_token_ids"] = prepared.prompt_ids
                if chat:
                    fields |= self._prompt_logprobs_field(prepared, output.prompt_logprobs)
                queue.put_nowait(("chunk", (chunk, fields)))
                first_output = False
                offset += len(output.text) + (len(echo.text) if echo is not None else 0)
                echo = None
            queue.put_nowait(("done", (prepared, last)))
        except APIError as error:
            queue.put_nowait(("error", error))

    def _stream_choice(self, prepared: Prepared, output: RequestOutput, chat: bool, offset: int,
                       parser: OutputParser | None = None, echo: EchoedPrompt | None = None) -> dict:  # fmt: skip
        with_logprobs = prepared.params.logprobs is not None and bool(output.logprobs)
        if chat:
            logprobs = self._formatter(prepared).chat(output.logprobs) if with_logprobs else None
            if parser is None:
                delta = {"content": output.text} if output.text or output.finish_reason is None else {}
                finish_reason = output.finish_reason
            else:
                delta, finish_reason = self._parsed_delta(parser, output)
                if not prepared.include_reasoning:
                    delta.pop("reasoning_content", None)
            choice = {"index": prepared.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if output.finish_reason is not None:  # as vLLM's chat chunks: stop_reason on the finishing one only
                choice["stop_reason"] = output.stop_reason
            return choice
        texts = texts_per_token(output) if with_logprobs else []
        return self._completion_text(prepared, output, texts, offset, echo)

    @staticmethod
    def _parsed_delta(parser: OutputParser, output: RequestOutput) -> tuple[dict, str | None]:
        """A chat delta of reasoning, content and whole tool calls, from one output's text."""
        first_call = parser.num_calls
        parsed = parser.push(output.text)
        if output.finish_reason is not None:
            parsed += parser.finish()
        delta = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content or (output.finish_reason is None and not delta and not parsed.tool_calls):
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [call.as_dict(first_call + k) for k, call in enumerate(parsed.tool_calls)]
        return delta, _finish_reason(output.finish_reason, parser.num_calls > 0)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """An answer that ends after calling tools ends with "tool_calls", as OpenAI's does."""
    return "tool_calls" if called and reason == "stop" else reason
