"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are strict (no "5" for 5) and forbid unknown fields, so a misspelt or unsupported parameter is a
400 that names it instead of being silently ignored. A null asks for nothing: any parameter sent as null is
taken as not sent (its default), as OpenAI's schema allows for every optional parameter. Parameters that
OpenAI clients send with a neutral value (`best_of=1`, an empty `suffix`, `modalities: ["text"]`) are declared
so that the neutral value passes; any other value is refused by `unsupported_params` or by the field's type. The value ranges here are those of the OpenAI API; limits that
depend on the served model (vocabulary, context length, logprob count) are checked in prompts.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_BAD_WORDS = 128
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # at most the vocabulary; the body-size limit bounds it first
MAX_CHOICES = 128  # n at most; a request's choices also count against the queue (HTTP 429 past it)
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as vLLM takes it


def _integral(value: Any) -> Any:
    """JSON Schema counts 4.0 as an integer; strict pydantic would not. Booleans stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field: strict (no "5", no true), but an integral float such as 4.0 is taken.
Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_sent(cls, data: Any) -> Any:
        """Generated clients send every optional field, null when unset (`"stream": null`): null means the
        default, whatever the field's type."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


StopStrings = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. The schema is always enforced, so `strict` changes nothing."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema; the alias keeps OpenAI's key.
    json_schema: Annotated[dict[str, Any], Field(alias="schema")]
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (JSON valid against its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @property
    def constrains(self) -> bool:
        return self.type != "text"


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one constraint on the answer's text. `json` is a JSON schema (an object, or
    that object as a JSON string), `regex` a regular expression the whole answer matches, `choice` a list of the
    only answers allowed, `grammar` a Lark grammar (llguidance's dialect) or a GBNF one, `json_object` any JSON
    object."""

    # `json` would shadow pydantic's BaseModel.json; the alias keeps vLLM's key.
    json_schema: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A request's constraint on its answer, from whichever parameter set it: kind is json_schema, json_object,
    regex, choice or grammar; param names the parameter (errors name it)."""

    kind: str
    value: Any
    param: str


class SamplingFields(_Strict):
    """What completions and chat completions share."""

    model: str | None = None  # omitted: the served model, as vLLM takes it
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[Int, Field(ge=-1, description="-1 or 0 turns it off")] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: Annotated[Int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: StopStrings | Annotated[list[StopStrings], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None  # vLLM's; 1 is neutral
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> bias
    response_format: ResponseFormat | None = None  # also on completions, as vLLM takes it
    include_stop_str_in_output: bool = False  # vLLM's
    min_tokens: Annotated[Int, Field(ge=0)] = 0  # vLLM's: no end of sequence, stop token or stop string before it
    skip_special_tokens: bool = True  # vLLM's
    # vLLM's: keep only the prompt's last k tokens (left truncation); -1: as many as the context leaves room for
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's earlier names of structured_outputs' fields, still sent by its older clients
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's: sampling picks only among these tokens
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    # vLLM's: words the output never contains (each as it tokenizes alone and after a space)
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name each token "token_id:N"
    return_token_ids: bool = False  # vLLM's: the answer carries its prompt's and each choice's token ids
    # vLLM's: None is the endpoint's default (completions add the tokenizer's special tokens, chat does not)
    add_special_tokens: bool | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")] | None = None  # vLLM's
    priority: Int = 0  # vLLM's; only 0, as on a vLLM server without priority scheduling
    # Taken because clients send them; they change nothing here. vLLM's spaces_between_special_tokens: a fast
    # (Rust) tokenizer joins special tokens without spaces either way, as in vLLM. vLLM's cache_salt: there is no
    # prefix cache shared between requests to salt. OpenAI's metadata, store, service_tier, prompt_cache_key and
    # safety_identifier: bookkeeping of OpenAI's platform.
    spaces_between_special_tokens: bool = True
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    # vLLM's per-request choice of grammar library: a constraint allows the same answers in any of them, and this
    # server has one (llguidance), so the name changes nothing.
    guided_decoding_backend: str | None = None
    # vLLM's beam search, taken at its neutral values only
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def constraints(self) -> list[Constraint]:
        """Every constraint the request sets (`_shared_problems` refuses more than one)."""
        found = []
        if self.response_format is not None and self.response_format.type == "json_object":
            found.append(Constraint("json_object", None, "response_format"))
        if self.response_format is not None and self.response_format.type == "json_schema":
            schema = self.response_format.json_schema
            found.append(Constraint("json_schema", None if schema is None else schema.json_schema, "response_format"))
        fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True) if self.structured_outputs else {}
        for name, kind in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                           ("grammar", "grammar"), ("json_object", "json_object")):  # fmt: skip
            if name in fields and fields[name] is not False:
                found.append(Constraint(kind, fields[name], f"structured_outputs.{name}"))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                found.append(Constraint(kind, getattr(self, name), name))
        return found

    def constraint(self) -> Constraint | None:
        """The request's constraint on its answer, or None."""
        found = self.constraints()
        return found[0] if found else None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _shared_problems(request: SamplingFields) -> list[tuple[str, str]]:
    problems = []
    constraints = request.constraints()
    if request.structured_outputs is not None and not any(
        c.param.startswith("structured_outputs") for c in constraints
    ):
        problems.append(("structured_outputs", "structured_outputs sets no constraint: give one of json, regex, "
                                               "choice, grammar or json_object"))  # fmt: skip
    if len(constraints) > 1:
        problems.append((constraints[1].param, f"{constraints[1].param} and {constraints[0].param} both constrain the "
                                               "answer: set one"))  # fmt: skip
    if request.min_tokens and constraints:
        problems.append(("min_tokens", f"min_tokens cannot hold back the end of an answer that {constraints[0].param} "
                                       "ends when it is complete"))  # fmt: skip
    if request.truncate_prompt_tokens == 0:
        problems.append(("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or at least 1"))
    if request.stream_options is not None and not request.stream:
        problems.append(("stream_options", "stream_options is only allowed when stream is true"))
    if request.allowed_token_ids is not None and constraints:
        problems.append(("allowed_token_ids", f"allowed_token_ids cannot be combined with {constraints[0].param}, "
                                              "which chooses the tokens itself"))  # fmt: skip
    if request.priority != 0:
        problems.append(("priority", "priority scheduling is not enabled on this server: priority must be 0"))
    if request.use_beam_search:
        problems.append(("use_beam_search", "beam search is not supported"))
    if request.length_penalty != 1.0:
        problems.append(("length_penalty", "length_penalty applies to beam search, which is not supported (use 1)"))
    problems += _response_format_problems(request.response_format)
    return problems


def _response_format_problems(response_format: ResponseFormat | None) -> list[tuple[str, str]]:
    if response_format is None:
        return []
    if response_format.type == "json_schema" and response_format.json_schema is None:
        return [("response_format", "response_format of type 'json_schema' needs a json_schema: {name, schema}")]
    if response_format.type != "json_schema" and response_format.json_schema is not None:
        return [("response_format", f"response_format.json_schema is only allowed with type 'json_schema', not "
                                    f"{response_format.type!r}")]  # fmt: skip
    return []


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[Int], Field(min_length=1)] | list[str] | list[list[Int]]
    max_tokens: Annotated[Int, Field(ge=0)] | None = None  # 0 only with echo: the prompt alone, scored
    logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # The answer starts with the prompt; with logprobs, so do its logprobs (the first prompt token's are null).
    echo: bool | None = None
    # vLLM's: top-N logprobs at every prompt token, in the choice's `prompt_logprobs`.
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    # A prompt-caching hint (Anthropic-style clients and LiteLLM send it); this server has no cache to steer.
    cache_control: dict[str, Any] | None = None


class RefusalPart(_Strict):
    """An assistant's refusal, as OpenAI answers it and clients send it back in the next turn's history."""

    type: Literal["refusal"]
    refusal: str


class ChatMessage(BaseModel):
    # Clients echo back assistant messages with extra keys (refusal, annotations, audio, ...): they are
    # conversation data, not parameters, so they are dropped rather than refused.
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _refusals_are_the_assistants(self) -> ChatMessage:
        if self.role != "assistant" and isinstance(self.content, list):
            if any(isinstance(part, RefusalPart) for part in self.content):
                raise ValueError(f"a {self.role} message cannot hold a refusal part: only an assistant's can")
        return self

    def parts(self) -> list[str]:
        """The texts of the content's parts (a refusal part's is what the assistant said)."""
        if not isinstance(self.content, list):
            return [] if self.content is None else [self.content]
        return [part.text if isinstance(part, TextPart) else part.refusal for part in self.content]

    def for_template(self) -> dict[str, Any]:
        """The message as the tokenizer's chat template takes it (`developer` is the newer name of `system`)."""
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        if isinstance(self.content, list):
            message["content"] = [{"type": "text", "text": text} for text in self.parts()]
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # e.g. OpenAI's `strict`, which changes nothing here

    name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^<>\n]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: Annotated[list[Literal["text"]], Field(min_length=1)] | None = None  # OpenAI's: text is the one
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the prompt ends with the assistant turn's opening (the default), or, with continue_final_message,
    # with the last message's own text, left open for the model to continue.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the answer's message starts with the last message's text when that message is the assistant's (the
    # start of an answer that continue_final_message continues)
    echo: bool = False
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # vLLM's, as on completions
    # OpenAI's. Qwen3.5 either thinks or does not: "none" and "minimal" render the prompt with thinking off, the
    # others as the template's default; the template also sees the value itself.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer
    documents: Annotated[list[dict[str, str]], Field(max_length=256)] | None = None  # vLLM's: for the template

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the answer must be a tool call."""
        return self.tool_choice not in (None, "none", "auto")


def unsupported_params(request: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str]]:
    """(param, message) for every parameter set to a value this server does not implement."""
    problems = _shared_problems(request)
    if isinstance(request, CompletionRequest):
        if request.max_tokens == 0 and not request.echo:
            problems.append(("max_tokens", "max_tokens=0 needs echo=true (the answer is then the prompt alone)"))
        if request.best_of not in (None, 1):
            problems.append(("best_of", f"best_of={request.best_of} is not supported (use 1)"))
        if request.suffix:
            problems.append(("suffix", "suffix is not supported"))
        return problems
    if request.forces_tool_call and not request.tools:
        problems.append(("tool_choice", "tool_choice 'required' or a named function needs tools"))
    if isinstance(request.tool_choice, NamedToolChoice) and request.tools:
        names = {tool.function.name for tool in request.tools}
        if request.tool_choice.function.name not in names:
            problems.append(("tool_choice", f"tool_choice names {request.tool_choice.function.name!r}, which is not "
                                            f"in tools ({', '.join(sorted(names))})"))  # fmt: skip
    forced_call = request.forces_tool_call
    constraint = request.constraint()
    if forced_call and constraint is not None:
        problems.append((constraint.param, f"{constraint.param} cannot constrain an answer that tool_choice forces to "
                                           "be a tool call"))  # fmt: skip
    if request.top_logprobs is not None and not request.logprobs:
        problems.append(("top_logprobs", "top_logprobs needs logprobs=true"))
    problems += continuation_problems(request)
    if request.continue_final_message and (forced_call or constraint is not None):
        problems.append(("continue_final_message", "continue_final_message cannot continue an answer that "
                                                   "tool_choice or a structured output shapes from its start"))  # fmt: skip
    return problems


def continuation_problems(request: ChatCompletionRequest | TokenizeChatRequest) -> list[tuple[str, str]]:
    """continue_final_message continues the last message, which a new assistant turn would close."""
    if request.continue_final_message and request.add_generation_prompt:
        return [("continue_final_message", "continue_final_message continues the last message, so "
                                           "add_generation_prompt must be false")]  # fmt: skip
    return []


# ---- responses ------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's: the stop string or stop token id that ended the choice; null when it ended otherwise (an end of sequence,
# the length limit).
StopReason = int | str | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, by token id


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None  # on the chunk that carries the finish_reason


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- the Responses API (POST /v1/responses) ----------------------------------------------------------------
# The text-only subset of OpenAI's Responses API that vLLM serves: messages, function tools and their calls and
# outputs, instructions, structured text, and `previous_response_id` over responses this server stored.


class InputText(_Strict):
    """A text part of an input message (`input_text`), or of an assistant message given back (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an echoed output_text's; always empty here
    logprobs: list[Any] | None = None


def _message_type(item: Any) -> Any:
    """An input item without a `type` is a message (OpenAI's EasyInputMessage)."""
    if isinstance(item, dict) and "type" not in item and "role" in item:
        return {**item, "type": "message"}
    return item


class InputMessage(BaseModel):
    # An output message given back as input carries its id, status and phase: conversation data, dropped.
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # id, status: the output item's, given back

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """A reasoning output item given back: its text becomes the next assistant turn's reasoning."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


InputItem = Annotated[
    Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")],
    BeforeValidator(_message_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^<>\n]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments are parsed from the model's text; nothing is enforced either way

    def as_chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(name=self.name, description=self.description,
                                                                 parameters=self.parameters))  # fmt: skip


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: OpenAI's response_format with the json_schema fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    description: str | None = None
    json_schema: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping earlier turns to fit) is not implemented
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    # vLLM's sampling extensions
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: Annotated[Int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None


# ---- tokenization (vLLM's /tokenize and /detokenize) ------------------------------------------------------


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # what the tokenizer's post-processor adds (Qwen3.5's adds nothing)
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Annotated[list[Tool], Field(max_length=512)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qwen35-jax"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def finite_logprob(value: float) -> float:
    """JSON has no -inf: a token of probability zero reports this floor instead (as vLLM does)."""
    return value if math.isfinite(value) else -9999.0
