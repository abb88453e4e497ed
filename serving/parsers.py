"""Qwen3.5's output formats, parsed out of a chat answer's text as it streams: reasoning in `<think>...</think>`
(vLLM's `qwen3` reasoning parser) and tool calls in `<tool_call>` blocks of `<function=NAME>` with
`<parameter=KEY>` values (vLLM's `qwen3_coder` tool parser).

`OutputParser.push(text)` takes each piece of generated text and returns what it completes: reasoning text,
content text and whole tool calls. Text that may be the start of a tag is held back until the next piece tells.
A tool call is returned once its block closes, with its arguments as one JSON string, so a streamed call arrives
in one delta. A block that does not parse stays content, as the model wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from qwen35_jax.serving.structured_output import JSON_OPTIONS, GrammarError

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
REASONING_PARSERS = ("qwen3", "none")
TOOL_CALL_PARSERS = ("qwen3_coder", "none")

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


@dataclasses.dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def _held_tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper start of one of `tags`."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


def _declared_type(schema: dict) -> str | None:
    """The JSON type a parameter's schema declares; of a list of types, the first that is not null."""
    kind = schema.get("type")
    return next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind


def parameter_value(raw: str, schema: dict | None):
    """A parameter's text as the JSON value its schema types it: strings stay text; numbers, booleans, objects and
    arrays are read as JSON where they parse. Without a schema, JSON where it parses, else the text."""
    kind = _declared_type(schema or {})
    if kind == "string":
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def parse_tool_block(block: str, tools: dict[str, dict]) -> ToolCall | None:
    """The call in the text between `<tool_call>` and `</tool_call>`, or None if it names no function."""
    match = _FUNCTION.search(block)
    if match is None:
        return None
    name = match.group(1).strip()
    properties = tools.get(name, {}).get("parameters", {}).get("properties", {})
    arguments = {key.strip(): parameter_value(value, properties.get(key.strip()))
                 for key, value in _PARAMETER.findall(match.group(2))}  # fmt: skip
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class OutputParser:
    """One chat answer's text -> reasoning, content and tool calls, piece by piece.

    in_reasoning: the prompt ends inside `<think>` (Qwen3.5's template opens it when thinking is on), so the
    answer starts as reasoning; otherwise an answer that opens with `<think>` enters it. tools: name -> the
    request's function definition, or None to leave tool calls as content. prefix: text the server put at the
    start of the answer in the prompt (a forced `<tool_call>` for tool_choice required or a named function).
    max_calls: the calls kept (1 for parallel_tool_calls false); later well-formed calls are dropped, as vLLM does."""

    def __init__(self, reasoning: bool, tools: dict[str, dict] | None, in_reasoning: bool = False, prefix: str = "",
                 max_calls: int | None = None):  # fmt: skip
        self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls
        self.state = "reasoning" if reasoning and in_reasoning else "start" if reasoning else "content"
        self.held = prefix
        self.strip_newlines = False  # after </think>, the content's leading newlines belong to the tag
        self.num_calls = 0

    def push(self, text: str) -> Delta:
        self.held += text
        delta = Delta()
        while True:
            step = self._advance()
            if step is None:
                return delta
            delta += step

    def finish(self) -> Delta:
        """What is held at the end of the answer: an unclosed reasoning block is reasoning, an unclosed tool block
        is content (or its call, if it names a function)."""
        delta = self.push("")
        if self.state == "tool":
            call = parse_tool_block(self.held[len(TOOL_START) :], self.tools or {})
            if call is not None:
                delta += self._call(call)
            else:
                delta.content += self.held
        elif self.state == "reasoning":
            delta.reasoning += self.held
        elif self.num_calls == 0 or self.held.strip():
            delta.content += self.held
        self.held = ""
        return delta

    def _advance(self) -> Delta | None:
        """One move on the held text, or None when it must wait for more."""
        if self.state == "start":
            stripped = self.held.lstrip()
            if stripped.startswith(THINK_START):
                self.held, self.state = stripped[len(THINK_START) :], "reasoning"
                return Delta()
            if not stripped or THINK_START.startswith(stripped):
                return None
            self.state = "content"
            return Delta()
        if self.state == "reasoning":
            return self._until(THINK_END, "reasoning", "content", strip_after=True)
        if self.state == "content":
            if self.strip_newlines:
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return None
                self.strip_newlines = False
            if self.tools is None:
                out, self.held = self.held, ""
                return Delta(content=out) if out else None
            return self._until(TOOL_START, "content", "tool", keep_tag=True)
        end = self.held.find(TOOL_END)
        if end < 0:
            return None
        block, self.held = self.held[len(TOOL_START) : end], self.held[end + len(TOOL_END) :]
        self.state = "content"
        call = parse_tool_block(block, self.tools or {})
        if call is None:
            return Delta(content=TOOL_START + block + TOOL_END)
        return self._call(call)

    def _call(self, call) -> Delta:
        """A parsed call, or nothing once max_calls are out."""
        self.num_calls += 1
        return Delta(tool_calls=[call] if self.max_calls is None or self.num_calls <= self.max_calls else [])

    def _until(self, tag: str, field: str, next_state: str, strip_after=False, keep_tag=False) -> Delta | None:
        """Emit the held text as `field` up to `tag`, then switch to `next_state`; hold an end that may start it.
        With tools, whitespace before a tool call is held too, so that it can be dropped between calls."""
        at = self.held.find(tag)
        if at >= 0:
            out = self.held[:at]
            self.held = self.held[at:] if keep_tag else self.held[at + len(tag) :]
            self.state, self.strip_newlines = next_state, strip_after
            return Delta(**{field: out if out.strip() or self.num_calls == 0 else ""})
        keep = _held_tag_prefix(self.held, (tag,))
        if field == "content" and self.num_calls:
            before = self.held[: len(self.held) - keep]
            keep += len(before) - len(before.rstrip())
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return Delta(**{field: out}) if out else None


# The answer after a forced tool call's prompt prefix, as a grammar (llguidance's Lark dialect), so that a forced
# call is always a call of one of the request's tools with its declared parameters, as vLLM guarantees for
# tool_choice "required" and a named function through its structured outputs.
_CALL_END = f"</function>\n{TOOL_END}"
_ANNOTATIONS = {"description", "title", "examples", "default", "deprecated"}


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value_grammar(schema: dict, definitions: dict) -> str:
    """One parameter's value, as `parameter_value` reads it back: a string-typed value, or one whose schema says
    nothing of it, is raw text up to `</parameter>` (a lazy lexeme: the first `\\n</parameter>` ends it) or one of
    its enum's strings; any other is compact JSON valid against the parameter's schema, whose `$defs` travel with
    it."""
    kind = _declared_type(schema)
    if kind is None and set(schema) - _ANNOTATIONS:  # no type, but a shape: $ref, anyOf, properties, ...
        kind = "json"
    if kind in (None, "string"):
        choices = schema.get("enum")
        if kind == "string" and choices and all(isinstance(c, str) and "\n</parameter>" not in c for c in choices):
            return "(" + " | ".join(_lark_literal(c) for c in choices) + ") " + _lark_literal("\n</parameter>")
        return "param_text"
    embedded = {**definitions, **schema, "x-guidance": JSON_OPTIONS}
    return f"%json {json.dumps(embedded, ensure_ascii=False)} " + _lark_literal("\n</parameter>")


def _arguments_grammar(index: int, parameters: dict | None) -> list[str]:
    """Rules `args{index}` (and its parameters') of one function: its declared parameters in their schema's order,
    the required ones always, the others optional; a function that declares no properties takes any parameter
    names with text values, unless its additionalProperties is false (then none). Raises GrammarError for a
    parameters object the grammar cannot follow."""
    parameters = parameters or {}
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise GrammarError("parameters' properties must be an object and its required a list")
    if any(set(key) & set("<>\n") for key in properties):  # the call's text could not say where the name ends
        raise GrammarError("a parameter name holds '<', '>' or a newline")
    required = {key for key in required if isinstance(key, str)}
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    rules, parts = [], []
    for position, (key, schema) in enumerate(properties.items()):
        name = f"param{index}_{position}"
        value = _value_grammar(schema if isinstance(schema, dict) else {}, definitions)
        rules.append(f"{name}: {_lark_literal(f'<parameter={key}>\n')} {value} {_lark_literal('\n')}")
        parts.append(name if key in required else f"{name}?")
    if not properties:
        parts = [] if parameters.get("additionalProperties") is False else ["free_param*"]
    rules.append(f"args{index}: {' '.join(parts) or _lark_literal('')}")
    return rules


def tool_call_grammar(tools: dict[str, dict], named: str | None = None, parallel: bool = True) -> str:
    """The Lark grammar of a chat answer whose prompt ends in the forced head of a tool call (`<tool_call>` then
    `<function=`, or `<function=NAME>` and a newline for a named function). tools: name -> the request's function
    definition. With a named function the answer finishes that one call; otherwise it names one of the tools and,
    when `parallel` (OpenAI's parallel_tool_calls, true by default), may add further whole calls after it (vLLM's
    "required": one call or more)."""
    rules = []
    for index, (name, function) in enumerate(tools.items()):
        if named is None or name == named:
            rules += _arguments_grammar(index, function.get("parameters"))
    rules += [
        f"free_param: {_lark_literal('<parameter=')} PARAM_NAME {_lark_literal('>\n')} param_text {_lark_literal('\n')}",
        "PARAM_NAME: /[^<>\\n]+/",
        # lazy: the value ends at the first "\n</parameter>", which the lexeme takes with it
        "param_text[lazy]: /(?s:.*)\\n<\\/parameter>/",
    ]
    if named is not None:
        index = list(tools).index(named)
        return "\n".join([f"start: args{index} {_lark_literal(_CALL_END)}", *rules])
    calls = " | ".join(f"{_lark_literal(f'{name}>\n')} args{index} {_lark_literal(_CALL_END)}"
                       for index, name in enumerate(tools))  # fmt: skip
    head = _lark_literal(f"\n{TOOL_START}\n<function=")
    start = f"start: call ({head} call)*" if parallel else "start: call"
    return "\n".join([start, f"call: {calls}", *rules])
