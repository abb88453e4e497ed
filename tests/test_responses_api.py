"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client against real uvicorn: on the live tiny
server (the answer is the chat path's, streamed and whole; stored responses continue, are read back and deleted;
bad requests get a 400 in the OpenAI shape), and on a scripted engine whose answer holds reasoning and a tool call
(the output items, streamed and whole, and the tool call's output going back in)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from _scripted import CALL

pytest_plugins = ["_server", "_scripted"]

SYSTEM, QUESTION = "Be brief.", "Say hello."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                "days": {"type": "integer"}}}}  # fmt: skip


def greedy(server, **kwargs):
    return server.client().responses.create(model=server.model_name, temperature=0.0, **kwargs)


def test_a_response_is_the_chat_answer_to_the_same_conversation(idle_server):
    """instructions are the system message and the input the user's: the same greedy text and token counts as a
    chat completion, and the length limit is status incomplete (max_output_tokens), as finish_reason length is."""
    response = greedy(idle_server, instructions=SYSTEM, input=QUESTION, max_output_tokens=6)
    chat = idle_server.client().chat.completions.create(
        model=idle_server.model_name, temperature=0.0, max_tokens=6,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    choice = chat.choices[0]
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 6
    assert response.output_text == (choice.message.content or "").lstrip("\n")
    assert choice.finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (
        response.instructions == SYSTEM and response.max_output_tokens == 6 and response.model == idle_server.model_name
    )


def test_a_streamed_response_sends_the_whole_answers_items(idle_server):
    """The event stream opens with created and in_progress, numbers its events from 0, and its text deltas add up
    to the final response's text, which is the whole answer's."""
    whole = greedy(idle_server, input=QUESTION, max_output_tokens=8)
    events = list(greedy(idle_server, input=QUESTION, max_output_tokens=8, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 8
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    done = [event.item.type for event in events if event.type == "response.output_item.done"]
    assert added == done == [item.type for item in final.output]


def test_previous_response_id_continues_the_stored_conversation(idle_server):
    """A follow-up's prompt is the first exchange then the new input: its input tokens are what /tokenize counts
    for that conversation. Instructions are not carried over, as OpenAI's are not."""
    first = greedy(idle_server, instructions=SYSTEM, input=QUESTION, max_output_tokens=4)
    second = greedy(idle_server, input="Again.", previous_response_id=first.id, max_output_tokens=4)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Again."}]  # fmt: skip
    count = httpx.post(f"{idle_server.root}/tokenize", json={"messages": messages}, timeout=60).json()["count"]
    assert second.usage.input_tokens == count and second.previous_response_id == first.id


def test_a_stored_response_is_read_back_and_deleted(idle_server):
    client = idle_server.client()
    response = greedy(idle_server, input=QUESTION, max_output_tokens=3)
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_an_unstored_response_cannot_be_continued(idle_server):
    response = greedy(idle_server, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        idle_server.client().responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(idle_server, input="Again.", previous_response_id=response.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
], ids=["image-input", "built-in-tool", "background", "too-long", "schema-missing", "unknown-param", "empty-input"])  # fmt: skip
def test_bad_requests_get_a_400_naming_the_parameter(idle_server, body, param):
    response = httpx.post(f"{idle_server.base_url}/responses", json={"model": idle_server.model_name, **body},
                          headers=idle_server.headers(), timeout=60)  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


# ---- reasoning and tool calls, on a scripted engine -----------------------------------------------------------


ANSWER = f"<think>\nNeed the weather.\n</think>\n\nChecking.\n{CALL}"


def check_items(output) -> None:
    reasoning, message, call = output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need the weather."
    assert message.type == "message" and message.content[0].text == "Checking.\n"
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2} and call.status == "completed"


def test_reasoning_text_and_a_tool_call_are_output_items(scripted):
    engine, client, _ = scripted
    engine.answer = ANSWER
    response = client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER_TOOL])
    check_items(response.output)
    assert response.status == "completed" and response.output_text == "Checking.\n"


def test_a_streamed_tool_call_is_announced_then_done(scripted):
    engine, client, _ = scripted
    engine.answer = ANSWER
    events = list(client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER_TOOL],
                                          stream=True))  # fmt: skip
    check_items(events[-1].response.output)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning.strip("\n") == "Need the weather."
    (arguments,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments.arguments) == {"city": "Paris", "days": 2}
    assert events[-1].type == "response.completed"


def test_a_tool_result_goes_back_as_a_tool_message(scripted):
    """The call and its output given back as input items render as the assistant's call and the tool's response."""
    engine, client, tokenizer = scripted
    engine.answer = "Sunny."
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]  # fmt: skip
    response = client.responses.create(model="scripted", input=items, tools=[WEATHER_TOOL])
    assert response.output_text == "Sunny."
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_reasoning_effort_none_turns_thinking_off(scripted):
    engine, client, tokenizer = scripted
    engine.answer = "Hi."
    client.responses.create(model="scripted", input="Hello", reasoning={"effort": "none"})
    assert tokenizer.decode(engine.prompts[-1]).endswith("Hello\nassistant\n<think>\n\n</think>\n\n")
    client.responses.create(model="scripted", input="Hello")
    assert tokenizer.decode(engine.prompts[-1]).endswith("Hello\nassistant\n")  # the special tokens decode to ""


def test_input_items_become_chat_messages():
    """A reasoning item leads the assistant turn after it; a message then calls are one assistant turn; a call
    after a tool's output opens a new turn; a tool output is a tool message."""
    from qwen35_jax.serving import protocol as api
    from qwen35_jax.serving.responses_api import input_messages

    request = api.ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
    ]})  # fmt: skip
    messages = input_messages(request.input)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[0]["content"] == "Weather?" and messages[1]["reasoning_content"] == "Look."
    assert messages[1]["content"] == "Checking." and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "noon"}
    assert [c["id"] for c in messages[4]["tool_calls"]] == ["c3"] and "reasoning_content" not in messages[4]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
