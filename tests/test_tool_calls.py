"""Tool calls and reasoning through the HTTP server, with the official `openai` client against real uvicorn: the
engine is a test double that answers every request with a chosen text, split into pieces the way a stream of
tokens arrives, so that the server's rendering of tools and its parsing of the answer are what is tested."""

from __future__ import annotations

import json

import openai
import pytest
from _scripted import CALL, MODEL, ScriptedEngine

pytest_plugins = ["_scripted"]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                "days": {"type": "integer"}}}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_tool_call_is_parsed(scripted):
    engine, client, tokenizer = scripted
    engine.answer = f"<think>\nNeed the weather.\n</think>\n\nChecking.\n{CALL}"
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    prompt = tokenizer.decode(engine.prompts[-1])
    assert '"get_weather"' in prompt and "<tools>" in prompt  # rendered by the checkpoint's template


def test_a_streamed_tool_call_comes_whole_in_one_delta(scripted):
    engine, client, _ = scripted
    engine.answer = f"<think>\nNeed the weather.\n</think>\n\nChecking.\n{CALL}"
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert reasoning.strip("\n") == "Need the weather." and content.strip() == "Checking."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_renders_the_tools_and_parses_no_call(scripted):
    """As vLLM: the model still sees the tools (a conversation with earlier calls stays coherent), but the answer
    is text whatever it holds."""
    engine, client, tokenizer = scripted
    engine.answer = CALL
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "<tools>" in prompt and '"get_weather"' in prompt and prompt.endswith("assistant\n")


@pytest.mark.parametrize("exclude", [False, True])
def test_exclude_tools_when_tool_choice_none_leaves_them_out_of_the_prompt(exclude):
    import asyncio

    from qwen35_jax.api import TINY_ASSETS
    from qwen35_jax.serving import protocol as api
    from qwen35_jax.serving.prompts import RequestPreparer
    from qwen35_jax.serving.server import ServerConfig
    from qwen35_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(TINY_ASSETS)
    config = ServerConfig(served_model_name=MODEL, max_model_len=4096, vocab_size=tokenizer.vocab_size,
                          exclude_tools_when_tool_choice_none=exclude)  # fmt: skip
    request = api.ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="none")
    ids, output_format = asyncio.run(RequestPreparer(ScriptedEngine(), tokenizer, config).chat_prompt(request))
    assert ("<tools>" in tokenizer.decode(ids)) is not exclude
    assert output_format.tools is None and output_format.prefix == ""


@pytest.mark.parametrize("tool_choice, forced", [
    ("required", "<tool_call>\n<function="),
    ({"type": "function", "function": {"name": "get_weather"}}, "<tool_call>\n<function=get_weather>\n"),
], ids=["required", "named"])  # fmt: skip
def test_a_forced_tool_choice_opens_the_call_in_the_prompt(scripted, tool_choice, forced):
    engine, client, tokenizer = scripted
    engine.answer = CALL.removeprefix(forced)  # the model writes the rest of the block
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL],
                                           tool_choice=tool_choice)  # fmt: skip
    assert tokenizer.decode(engine.prompts[-1]).endswith("assistant\n" + forced)  # decode drops <|im_start|>
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert reply.choices[0].message.content is None
    # The rest of the call is under a grammar of the tools' calls (test_structured_output walks it closely).
    grammar = engine.params[-1].grammar
    assert grammar.param == "tool_choice"
    state = grammar.start()
    assert all(state.accept(token) for token in tokenizer.encode(engine.answer))
    assert not grammar.start().accept(tokenizer.encode("nope")[0])


def test_tool_choice_auto_leaves_the_answer_free(scripted):
    engine, client, _ = scripted
    engine.answer = CALL
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL])
    assert engine.params[-1].grammar is None


def test_enable_thinking_false_reaches_the_template(scripted):
    engine, client, tokenizer = scripted
    engine.answer = "Plain answer."
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert tokenizer.decode(engine.prompts[-1]).endswith("<think>\n\n</think>\n\n")
    assert reply.choices[0].message.content == "Plain answer."
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


def test_thinking_on_starts_the_answer_in_reasoning(scripted):
    engine, client, _ = scripted
    engine.answer = "Let me see.\n</think>\n\nHello."
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    message = reply.choices[0].message
    assert message.content == "Hello." and message.model_extra["reasoning_content"] == "Let me see."


@pytest.mark.parametrize("fields, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "a<b"}}]), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools"),
], ids=["required-without-tools", "unknown-named", "bad-name", "not-a-function"])  # fmt: skip
def test_bad_tool_requests_get_a_400_naming_the_param(scripted, fields, param):
    _, client, _ = scripted
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **fields)
    assert raised.value.body["param"].startswith(param), raised.value.body


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": [1, 2]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
    {"type": "object", "properties": {"a>b": {"type": "string"}}},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": "x"}}},
], ids=["properties-not-object", "required-not-list", "name-with-bracket", "bad-schema"])  # fmt: skip
def test_a_forced_call_with_parameters_no_grammar_can_follow_gets_a_400_naming_tools(scripted, parameters):
    _, client, _ = scripted
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required")
    assert caught.value.body["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [None, False])
def test_parallel_tool_calls_false_keeps_the_first_call(scripted, parallel, stream):
    """An answer with two calls gives both by default, and only the first with parallel_tool_calls false (vLLM
    drops the rest the same way, under tool_choice auto, where no grammar holds the model to one call)."""
    engine, client, _ = scripted
    second = CALL.replace("Paris", "Lyon")
    engine.answer = f"{CALL}\n{second}"
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], stream=stream,
                                           **extra)  # fmt: skip
    if stream:
        chunks = list(reply)
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls, content = reply.choices[0].message.tool_calls, reply.choices[0].message.content
        finish = reply.choices[0].finish_reason
    cities = [json.loads(call.function.arguments)["city"] for call in calls]
    assert cities == (["Paris"] if parallel is False else ["Paris", "Lyon"])
    assert finish == "tool_calls" and not (content or "").strip()
    if stream:
        assert [call.index for call in calls] == list(range(len(calls)))
