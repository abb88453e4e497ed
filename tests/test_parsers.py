"""Qwen3.5's reasoning and tool-call formats (serving/parsers.py) on scripted answers: every split of a streamed
answer gives what the whole answer gives, tool-call arguments take their schema's types, and what does not parse
stays content."""

from __future__ import annotations

import json

import pytest

from qwen35_jax.serving.parsers import OutputParser, parameter_value, parse_tool_block

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "where": {"type": ["object", "null"]}}}}  # fmt: skip
TOOLS = {"get_weather": WEATHER}

CALL_PARIS = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"  # fmt: skip
CALL_NUMBER_CITY = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"  # fmt: skip
ANSWER = f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n{CALL_PARIS}\n{CALL_NUMBER_CITY}"


def parse(pieces, tools=TOOLS, reasoning=True, in_reasoning=False, prefix="") -> tuple[str, str, list]:
    parser = OutputParser(reasoning, tools, in_reasoning, prefix)
    reasoning_text = content = ""
    calls = []
    for delta in [parser.push(piece) for piece in pieces] + [parser.finish()]:
        reasoning_text += delta.reasoning
        content += delta.content
        calls += [(call.name, json.loads(call.arguments)) for call in delta.tool_calls]
    return reasoning_text, content, calls


def test_reasoning_content_and_two_calls():
    reasoning, content, calls = parse([ANSWER])
    assert reasoning == "\nThe user wants weather.\n" and content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris", "days": 3}),
                     ("get_weather", {"city": "42", "metric": True, "hours": [1, 2]})]  # fmt: skip


def test_every_split_of_the_stream_gives_the_whole_answer():
    whole = parse([ANSWER])
    for at in range(len(ANSWER) + 1):
        assert parse([ANSWER[:at], ANSWER[at:]]) == whole, at
    assert parse(list(ANSWER)) == whole  # one character at a time


def test_a_prompt_that_opens_the_think_block():
    """Qwen3.5's template ends the prompt with `<think>\\n` when thinking is on: the answer starts as reasoning."""
    assert parse(["Hmm.\n</think>\n\nHi!"], in_reasoning=True) == ("Hmm.\n", "Hi!", [])
    assert parse(["Still thinking"], in_reasoning=True) == ("Still thinking", "", [])


def test_without_tools_or_reasoning_the_text_is_content():
    assert parse([ANSWER], tools=None, reasoning=False) == ("", ANSWER, [])
    assert parse([ANSWER], tools=None)[1].startswith("Let me check.\n<tool_call>")


def test_a_block_that_names_no_function_stays_content():
    text = "Try <tool_call>\nnot a call\n</tool_call> done"
    assert parse([text]) == ("", text, [])
    unclosed = "ok <tool_call>\n<function=get_weather>\n<parameter=city>\nRome"
    assert parse([unclosed]) == ("", "ok ", [("get_weather", {"city": "Rome"})])


def test_a_forced_call_prefix_is_part_of_the_answer():
    """tool_choice required puts `<tool_call>\\n<function=` in the prompt: the model writes the rest."""
    rest = "get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    assert parse([rest], prefix="<tool_call>\n<function=") == ("", "", [("get_weather", {"city": "Oslo"})])


@pytest.mark.parametrize(("raw", "schema", "value"), [
    ("7", {"type": "integer"}, 7), ("7.0", {"type": "integer"}, 7), ("2.5", {"type": "number"}, 2.5),
    ("false", {"type": "boolean"}, False), ("007", {"type": "string"}, "007"), ('{"a": 1}', None, {"a": 1}),
    ("plain words", {"type": "object"}, "plain words"), ("null", {"type": ["string", "null"]}, "null"),
])  # fmt: skip
def test_parameter_values_take_their_schema_type(raw, schema, value):
    assert parameter_value(raw, schema) == value


def test_unknown_function_keeps_json_values():
    call = parse_tool_block("\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n", TOOLS)
    assert (call.name, json.loads(call.arguments)) == ("other", {"n": 5}) and call.id.startswith("call_")
