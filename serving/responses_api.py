"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), served through the chat path.

A request becomes a chat request (`to_chat`): its `instructions` a system message, its input items messages (a
`function_call` item an assistant tool call, a `function_call_output` item a tool message, a `reasoning` item the
next assistant turn's reasoning), `text.format` the response_format, and `reasoning.effort` "none" or "minimal"
the template's `enable_thinking=False`. The chat path prepares and runs it; the answer's text goes through the
same output parser as a chat answer, and `OutputItems` turns what the parser returns into the Responses API's
output items: a `reasoning` item, a `message` with one `output_text` part, and a `function_call` item per call.
A streamed answer is the same walk with every step sent as an SSE event, so the streamed items and the final
response agree. The text that opens an item is held back while it is only whitespace (the blank line after
`</think>`), and a message that would hold only whitespace before a call is not opened.

Responses are kept in memory (`ResponseStore`, the most recent `MAX_STORED`) unless the request says
`store: false`, so `previous_response_id` can continue a conversation and `GET /v1/responses/{id}` can read one
back; a restart forgets them.
"""

from __future__ import annotations

import collections
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from qwen35_jax.serving import protocol as api
from qwen35_jax.serving.errors import APIError, validation_message
from qwen35_jax.serving.parsers import ToolCall
from qwen35_jax.serving.prompts import Prepared
from qwen35_jax.serving.responses import finish_error
from qwen35_jax.serving.submission import Submission

MAX_STORED = 1024
# The chat request's parameters, as this API names them (for the `param` of an error).
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format", "chat_template_kwargs": "reasoning"}  # fmt: skip


class ResponseStore:
    """The most recent stored responses: each one's body and its conversation (the chat messages it was answered
    from, its instructions excluded, then its own answer as an assistant message)."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> None:
        self._items[body["id"]] = (body, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def body(self, response_id: str) -> dict:
        return self._find(response_id)[0]

    def conversation(self, response_id: str) -> list[dict]:
        try:
            return self._find(response_id)[1]
        except APIError:
            raise APIError(
                400,
                f"previous response {response_id!r} not found: it was not stored (store: false), "
                "or the server restarted or has since dropped it",
                "previous_response_id",
            ) from None

    def delete(self, response_id: str) -> None:
        self._find(response_id)
        del self._items[response_id]

    def _find(self, response_id: str) -> tuple[dict, list[dict]]:
        if response_id not in self._items:
            raise APIError(404, f"response {response_id!r} not found", "response_id")
        return self._items[response_id]


def input_messages(items: str | list) -> list[dict]:
    """The chat messages of a request's input: a string is one user message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages, reasoning = [], None
    for item in items:
        if isinstance(item, api.ReasoningItem):  # it leads the assistant turn that follows it
            reasoning = item.text()
            continue
        if isinstance(item, api.InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, api.FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                         "arguments": item.arguments}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant":  # the calls of one assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if reasoning is not None and messages and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, None
    return messages


def _response_format(text: api.TextOptions | None) -> api.ResponseFormat | None:
    if text is None or text.format is None or text.format.type == "text":
        return None
    fmt = text.format
    if fmt.type == "json_object":
        return api.ResponseFormat(type="json_object")
    if fmt.name is None or fmt.json_schema is None:
        raise APIError(400, "text.format of type 'json_schema' needs a name and a schema", "text.format")
    schema = api.JsonSchemaFormat.model_validate({"name": fmt.name, "description": fmt.description,
                                                  "schema": fmt.json_schema, "strict": fmt.strict})  # fmt: skip
    return api.ResponseFormat(type="json_schema", json_schema=schema)


def to_chat(request: api.ResponsesRequest, store: ResponseStore) -> tuple[api.ChatCompletionRequest, list[dict]]:
    """The chat request that answers `request`, and the conversation it continues (without the instructions). A
    value the chat request refuses is a 400, as it would be there."""
    try:
        return _to_chat(request, store)
    except ValidationError as error:
        message, param = validation_message(list(error.errors()) or [{"msg": "invalid request"}])
        raise APIError(400, message, PARAMS.get(param, param)) from None


def _to_chat(request: api.ResponsesRequest, store: ResponseStore) -> tuple[api.ChatCompletionRequest, list[dict]]:
    conversation = list(store.conversation(request.previous_response_id)) if request.previous_response_id else []
    conversation += input_messages(request.input)
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    tool_choice = request.tool_choice
    if isinstance(tool_choice, api.FunctionToolChoice):
        tool_choice = api.NamedToolChoice(type="function", function=api.NamedFunction(name=tool_choice.name))
    effort = request.reasoning.effort if request.reasoning is not None else None
    chat = api.ChatCompletionRequest(
        model=request.model, messages=[api.ChatMessage.model_validate(m) for m in system + conversation],
        max_completion_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        top_k=request.top_k, min_p=request.min_p, seed=request.seed, repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        tools=[tool.as_chat_tool() for tool in request.tools] if request.tools else None, tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls, response_format=_response_format(request.text),
        stream=request.stream, user=request.user,
        chat_template_kwargs={"enable_thinking": False} if effort in ("none", "minimal") else None,
    )  # fmt: skip
    return chat, conversation


def renamed(error: APIError) -> APIError:
    """A chat-path error with its parameter named as this API names it."""
    error.param = PARAMS.get(error.param, error.param)
    return error


class OutputItems:
    """The output items of one answer, built as the parser's pieces arrive; every change is also an event (a
    streamed answer sends them, a whole one drops them)."""

    def __init__(self):
        self.items: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self.open: dict | None = None  # the reasoning or message item still growing
        self.held = ""  # whitespace that would open an item, held until text follows
        self.reasoning_tokens = 0  # tokens of outputs that were all reasoning
        self.last = None  # the answer's last engine output

    def add(self, kind: str, text: str) -> None:
        """Reasoning or content text, in an item of that kind (`reasoning` or `message`)."""
        if not text:
            return
        if self.open is None or self.open["type"] != kind:
            if not (self.held + text).strip():
                self.held += text
                return
            self._start(kind)
            text, self.held = (self.held + text).lstrip("\n"), ""
        part = self.open["content"][0]
        part["text"] += text
        index = len(self.items) - 1
        if kind == "reasoning":
            self.events.append(("response.reasoning_text.delta", {"item_id": self.open["id"], "output_index": index,
                                                                  "content_index": 0, "delta": text}))  # fmt: skip
        else:
            self.events.append(("response.output_text.delta", {"item_id": self.open["id"], "output_index": index,
                                                               "content_index": 0, "delta": text, "logprobs": []}))  # fmt: skip

    def call(self, call: ToolCall) -> None:
        self.close()
        self.held = ""  # whitespace before a call opens no message
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}  # fmt: skip
        self.items.append(item)
        index = len(self.items) - 1
        self.events.append(("response.output_item.added", {"output_index": index, "item": dict(item)}))
        item["arguments"] = call.arguments
        self.events.append(("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                       "delta": call.arguments}))  # fmt: skip
        self.events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                      "name": call.name,
                                                                      "arguments": call.arguments}))  # fmt: skip
        item["status"] = "completed"
        self.events.append(("response.output_item.done", {"output_index": index, "item": dict(item)}))

    def _start(self, kind: str) -> None:
        self.close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}  # fmt: skip
        else:
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}  # fmt: skip
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        self.events.append(("response.output_item.added", {"output_index": index, "item": copy.deepcopy(item)}))
        if kind == "message":
            self.events.append(("response.content_part.added", {"item_id": item["id"], "output_index": index,
                                                                "content_index": 0,
                                                                "part": dict(item["content"][0])}))  # fmt: skip

    def close(self) -> None:
        """Ends the growing item, if any (a reasoning item's trailing newlines trimmed)."""
        item, self.open = self.open, None
        if item is None:
            return
        index, part = len(self.items) - 1, item["content"][0]
        item["status"] = "completed"
        if item["type"] == "reasoning":
            part["text"] = part["text"].rstrip("\n")
            self.events.append(("response.reasoning_text.done", {"item_id": item["id"], "output_index": index,
                                                                 "content_index": 0, "text": part["text"]}))  # fmt: skip
        else:
            self.events.append(("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "text": part["text"],
                                                              "logprobs": []}))  # fmt: skip
            self.events.append(("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                               "content_index": 0, "part": dict(part)}))  # fmt: skip
        self.events.append(("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}))

    def finish(self) -> None:
        """The end of the answer: held whitespace becomes the message when nothing else was said."""
        if self.held and not self.items:
            self._start("message")
            self.open["content"][0]["text"], self.held = self.held, ""
        self.close()

    def assistant_message(self) -> dict:
        """The answer as an assistant chat message, for a conversation that continues it."""
        message = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] += item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})  # fmt: skip
        return message


class ResponsesAPI:
    """Answers of one served model in the Responses API's shapes, and the responses it stored."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.store = ResponseStore()

    def body(self, request: api.ResponsesRequest, response_id: str, created: int, status: str, items: OutputItems,
             last=None, error: dict | None = None) -> dict:  # fmt: skip
        usage = None
        if last is not None:
            usage = {"input_tokens": last.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": last.num_output_tokens,
                     "output_tokens_details": {"reasoning_tokens": items.reasoning_tokens},
                     "total_tokens": last.num_prompt_tokens + last.num_output_tokens}  # fmt: skip
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else {}
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": error, "incomplete_details": incomplete, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": self.model_name,
            "output": copy.deepcopy(items.items),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning.model_dump() if request.reasoning else {"effort": None, "summary": None},
            "store": request.store, "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": {"type": "text"}} | text,
            "tool_choice": (request.tool_choice.model_dump() if isinstance(request.tool_choice, api.FunctionToolChoice)
                            else request.tool_choice or "auto"),
            "tools": [tool.model_dump() for tool in request.tools or ()],
            "top_p": 1.0 if request.top_p is None else request.top_p, "truncation": "disabled",
            "usage": usage, "user": request.user, "metadata": request.metadata or {},
        }  # fmt: skip

    async def _walk(self, submission: Submission, items: OutputItems):
        """Feeds the answer's outputs through its parser into `items`, yielding after each; the last output is left
        in `items.last` (a failed or aborted one is not parsed)."""
        prepared: Prepared = submission.prepared
        parser = prepared.output_format.parser()
        items.last = None
        async for output in submission.outputs():
            items.last = output
            if output.finish_reason in ("error", "abort"):
                return
            parsed = parser.push(output.text)
            if output.finish_reason is not None:
                parsed += parser.finish()
            if parsed.reasoning and not parsed.content and not parsed.tool_calls:
                items.reasoning_tokens += len(output.token_ids)
            items.add("reasoning", parsed.reasoning)
            items.add("message", parsed.content)
            for call in parsed.tool_calls:
                items.call(call)
            if output.finish_reason is not None:
                items.finish()
            yield

    async def answer(self, request: api.ResponsesRequest, submission: Submission, conversation: list[dict]) -> dict:
        """The whole response of a request that does not stream; raises the finish's APIError if it failed."""
        response_id, created, items = submission.prepared.response_id, int(time.time()), OutputItems()
        async for _ in self._walk(submission, items):
            pass
        error = finish_error(items.last)
        if error is not None:
            raise error
        body = self.body(request, response_id, created, _status(items.last), items, items.last)
        self._keep(request, body, conversation, items)
        return body

    async def stream(self, request: api.ResponsesRequest, submission: Submission,
                     conversation: list[dict]) -> AsyncIterator[str]:  # fmt: skip
        """The response as SSE events: created, in_progress, each item's events, then completed (or incomplete);
        a failed or aborted request ends with an `error` event and `response.failed`."""
        response_id, created, items = submission.prepared.response_id, int(time.time()), OutputItems()
        sequence = 0

        def event(kind: str, fields: dict) -> str:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            opening = self.body(request, response_id, created, "in_progress", items)
            yield event("response.created", {"response": opening})
            yield event("response.in_progress", {"response": opening})
            try:
                async for _ in self._walk(submission, items):
                    for kind, fields in items.events:
                        yield event(kind, fields)
                    items.events.clear()
            except APIError as err:  # the engine stopped under the stream
                items.last = None
                failure = err
            else:
                failure = finish_error(items.last)
            if failure is not None:
                error = {"code": failure.code or "server_error", "message": failure.message}
                yield event("error", {"code": error["code"], "message": failure.message, "param": failure.param})
                body = self.body(request, response_id, created, "failed", items, items.last, error)
                yield event("response.failed", {"response": body})
                return
            status = _status(items.last)
            body = self.body(request, response_id, created, status, items, items.last)
            self._keep(request, body, conversation, items)
            yield event("response.completed" if status == "completed" else "response.incomplete", {"response": body})
        finally:
            submission.close()

    def _keep(self, request: api.ResponsesRequest, body: dict, conversation: list[dict], items: OutputItems) -> None:
        if request.store:
            self.store.put(body, [*conversation, items.assistant_message()])


def _status(last) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"
