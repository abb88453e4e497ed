"""From a validated request body to what the engine takes: the prompt's token ids and `GenerationParams`.

pydantic (protocol.py) has checked every field on its own; the checks here need the model: the served
name, the vocabulary, the context length, the tokenizer and its chat template, the logprob count. Each
failure is an `APIError` (a 4xx) that names the parameter. The result is a `Prepared`, which
`OpenAIServer.submit` hands to the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import uuid

from qwen35_jax.sampling import MAX_LOGIT_BIAS, SamplingParams
from qwen35_jax.serving import protocol as api
from qwen35_jax.serving.engine import GenerationParams
from qwen35_jax.serving.errors import APIError
from qwen35_jax.serving.parsers import THINK_END, THINK_START, TOOL_START, OutputParser, tool_call_grammar
from qwen35_jax.serving.scheduler import RequestRejected
from qwen35_jax.serving.server_config import ServerConfig
from qwen35_jax.serving.structured_output import Grammar, GrammarCompiler, GrammarError
from qwen35_jax.serving.token_filter import TokenFilter
from qwen35_jax.tokenizer import IncrementalDetokenizer

ASSISTANT_TURN = "<|im_start|>assistant"  # where the answer starts in a Qwen chat prompt


@dataclasses.dataclass
class Prepared:
    """One HTTP request, validated and ready for `Engine.submit`; plain data, built by `RequestPreparer`.

    It lives on the event loop for the whole request: `Submission` carries it, and the response builders
    read its id, its `params.logprobs` and `include_usage`. At submit the engine copies the prompt into
    the scheduler's `Request` and keeps the (frozen) params in its `Generation`, so nothing here changes
    once the request runs.
    """

    request_id: str  # the engine's id of this choice
    prompt_ids: list[int]
    params: GenerationParams
    include_usage: bool  # the client asked for a usage chunk at the end of the stream
    response_id: str = ""  # the id of the answer its choices share ("": request_id)
    index: int = 0  # the choice's index in the answer: prompt * n + sample
    sample: int = 0  # which of the n samples of its prompt (the prompt's tokens count once, with sample 0)

    output_format: OutputFormat | None = None  # chat: how its text splits into reasoning, content and tool calls
    echo: EchoedPrompt | None = None  # completions with echo: the prompt the answer starts with
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the choice's field of that name, with this top-N
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every streamed chunk carries the usage so far
    token_names_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # vLLM's: the answer carries the prompt's and the output's token ids
    include_reasoning: bool = True  # vLLM's: chat answers carry their reasoning

    def __post_init__(self):
        self.response_id = self.response_id or self.request_id


@dataclasses.dataclass(frozen=True)
class EchoedPrompt:
    """The prompt as an echoing answer repeats it: a text prompt as sent, a token-id prompt decoded (special
    tokens kept), and the text each prompt token adds, for the logprobs' `text_offset` (they index the decoded
    prompt, which is the text as sent whenever the tokenizer gives it back unchanged)."""

    text: str
    token_texts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """What the chat answer's parser must know from the prompt (serving/parsers.py)."""

    reasoning: bool  # split out <think> blocks
    tools: dict[str, dict] | None  # the request's functions by name, when tool calls are parsed
    in_reasoning: bool = False  # the prompt ends inside <think>
    prefix: str = ""  # the start of the answer that the prompt already holds (a forced tool call)
    parallel: bool = True  # OpenAI's parallel_tool_calls: false keeps the answer's first call only

    def parser(self) -> OutputParser:
        return OutputParser(
            self.reasoning, self.tools, self.in_reasoning, self.prefix, max_calls=None if self.parallel else 1
        )


class RequestPreparer:
    """Checks a request against the served model and turns it into a `Prepared`."""

    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        # Built once (about 2 s at Qwen3.5's vocabulary on a CPU, docs/structured_output.md); the grammar allows the EOS
        # ids the engine stops on.
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, config.vocab_size,
                                                                        engine.eos_token_ids)  # fmt: skip

    async def completion(self, request: api.CompletionRequest) -> list[Prepared]:
        """One `Prepared` per choice: each prompt of a batch, n times."""
        self.check_request(request)
        if request.echo:
            self._need_tokenizer("echo")
        prompt_logprobs = self._prompt_logprobs(request)
        texts, prompts = await self.completion_prompts(request)
        grammar = await self.grammar(request)
        token_filter = await self.token_filter(request)
        params = [self.generation_params(request, len(ids), request.max_tokens,
                                         self.config.default_completion_max_tokens, request.logprobs,
                                         prompt_logprobs=prompt_logprobs, grammar=grammar, token_filter=token_filter)
                  for ids in prompts]  # fmt: skip
        choices = self._choices("cmpl", request, prompts, params)
        if request.prompt_logprobs is not None:
            choices = [dataclasses.replace(choice, prompt_logprobs=request.prompt_logprobs) for choice in choices]
        if not request.echo:
            return choices
        echoes = [await asyncio.to_thread(self._echoed, text, ids) for text, ids in zip(texts, prompts, strict=True)]
        n = request.n or 1
        return [dataclasses.replace(choice, echo=echoes[choice.index // n]) for choice in choices]

    def _echoed(self, text: str | None, ids: list[int]) -> EchoedPrompt:
        """`text`: the prompt as sent, None for token ids."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        token_texts = [detokenizer.push(token) for token in ids]
        token_texts[-1] += detokenizer.flush()
        return EchoedPrompt("".join(token_texts) if text is None else text, tuple(token_texts))

    def _prompt_logprobs(self, request: api.CompletionRequest) -> int | None:
        """The top-N the engine returns at each prompt token: for echo with logprobs and for vLLM's prompt_logprobs,
        the larger of the two (each answer keeps its own N); None when neither asks."""
        return self._checked_prompt_logprobs({"prompt_logprobs": request.prompt_logprobs,
                                              "logprobs": request.logprobs if request.echo else None})  # fmt: skip

    def _checked_prompt_logprobs(self, wanted: dict[str, int | None]) -> int | None:
        """wanted: the top-N each parameter asks for at the prompt's tokens (None: that one asks nothing)."""
        wanted = {param: n for param, n in wanted.items() if n is not None}
        if not wanted:
            return None
        param = next(iter(wanted))
        if not self.config.prompt_logprobs:
            raise APIError(400, f"{param}: prompt logprobs (echo with logprobs, prompt_logprobs) are off on this "
                                "server; start it with --prompt-logprobs-chunk N (e.g. 256)", param,
                           "unsupported_parameter")  # fmt: skip
        if wanted.get("prompt_logprobs", 0) > self.config.max_logprobs:
            raise APIError(400, f"at most {self.config.max_logprobs} prompt_logprobs per token, got "
                                f"{wanted['prompt_logprobs']}", "prompt_logprobs")  # fmt: skip
        return max(wanted.values())

    async def chat(self, request: api.ChatCompletionRequest) -> list[Prepared]:
        self.check_request(request)
        grammar = await self.grammar(request)
        structured = grammar is not None
        grammar = grammar or await self.forced_call_grammar(request)
        token_filter = await self.token_filter(request)
        ids, output_format = await self.chat_prompt(request, structured=structured)
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt_logprobs = self._checked_prompt_logprobs({"prompt_logprobs": request.prompt_logprobs})
        params = self.generation_params(request, len(ids), max_tokens, self.config.default_chat_max_tokens, logprobs,
                                        prompt_logprobs=prompt_logprobs, grammar=grammar, token_filter=token_filter,
                                        max_tokens_param="max_completion_tokens" if request.max_completion_tokens
                                        else "max_tokens")  # fmt: skip
        echo = _chat_echo(request)
        choices = self._choices("chatcmpl", request, [ids], [params])
        return [dataclasses.replace(choice, output_format=output_format, prompt_logprobs=request.prompt_logprobs,
                                    echo=None if echo is None else EchoedPrompt(echo, ()),
                                    include_reasoning=request.include_reasoning)
                for choice in choices]  # fmt: skip

    def _choices(self, kind: str, request: api.SamplingFields, prompts: list[list[int]],
                 params: list[GenerationParams]) -> list[Prepared]:  # fmt: skip
        """Choice `prompt * n + sample`. A seeded request's samples take the seeds seed, seed + 1, ... (as 64-bit
        integers), so that they differ from each other and each repeats. The answer's id is `kind`-, then vLLM's
        request_id when the client gave one; the engine's ids of its choices stay unique whatever the client sent."""
        response_id = f"{kind}-{request.request_id or uuid.uuid4().hex}"
        engine_id = response_id if request.request_id is None else f"{response_id}-{uuid.uuid4().hex[:12]}"
        n = request.n or 1
        choices = []
        for p, (ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            for sample in range(n):
                index = p * n + sample
                choice_params = prompt_params
                if sample:
                    sampling = prompt_params.sampling
                    seed = secrets.randbits(63) if request.seed is None else _wrap_int64(request.seed + sample)
                    choice_params = dataclasses.replace(
                        prompt_params, sampling=dataclasses.replace(sampling, seed=seed)
                    )
                request_id = engine_id if len(prompts) * n == 1 else f"{engine_id}-{index}"
                choices.append(Prepared(request_id, ids, choice_params, _include_usage(request), response_id, index,
                                        sample, continuous_usage=_continuous_usage(request),
                                        token_names_as_ids=request.return_tokens_as_token_ids,
                                        return_token_ids=request.return_token_ids))  # fmt: skip
        return choices

    # ---- checks ------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", "model", "model_not_found")  # fmt: skip

    def check_request(self, request: api.SamplingFields) -> None:
        self.check_model(request.model)
        problems = api.unsupported_params(request)
        if problems:
            param, message = problems[0]
            raise APIError(400, message, param, "unsupported_parameter")
        if not self.engine.is_running():
            raise APIError(503, "the engine is not running")

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty: at least one prompt token is needed", param)
        self.check_in_vocabulary(ids, param)
        if len(ids) >= self.config.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens, but --max-model-len is "
                                f"{self.config.max_model_len}: the prompt and at least one output token must "
                                f"fit", param, "context_length_exceeded")  # fmt: skip

    def check_in_vocabulary(self, ids, param: str, name: str = "token ids") -> None:
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})", param)

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"model {self.config.served_model_name!r} has no tokenizer: send the prompt as a "
                                "list of token ids to /v1/completions", param)  # fmt: skip

    # ---- prompts -----------------------------------------------------------------------------------------
    async def completion_prompts(self, request: api.CompletionRequest) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt as sent (None for token ids) and its token ids: a string, a list of ids, or a batch (a list of
        either)."""
        prompt = request.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if not batch:
            raise APIError(400, "the prompt list is empty", "prompt")
        texts, prompts = [], []
        for one in batch:
            if isinstance(one, list):
                ids = list(one)
            else:
                self._need_tokenizer("prompt")
                _require_unicode(one, "prompt")
                special = True if request.add_special_tokens is None else request.add_special_tokens
                ids = await asyncio.to_thread(self.tokenizer.encode, one, special)
            kept = self.truncated(ids, request)
            self.check_prompt(kept, "prompt")
            # A cut prompt is echoed as its kept tokens decoded, as a token-id prompt is.
            texts.append(None if isinstance(one, list) or len(kept) < len(ids) else one)
            prompts.append(kept)
        return texts, prompts

    def truncated(self, ids: list[int], request: api.SamplingFields) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k ids (-1: the context less one output token)."""
        k = request.truncate_prompt_tokens
        if k is None:
            return ids
        if k > self.config.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens ({k}) exceeds --max-model-len "
                                f"({self.config.max_model_len})", "truncate_prompt_tokens")  # fmt: skip
        return ids[-(self.config.max_model_len - 1 if k == -1 else k) :]

    async def chat_prompt(self, request: api.ChatCompletionRequest,
                          structured: bool = False) -> tuple[list[int], OutputFormat]:  # fmt: skip
        """The prompt's ids, rendered by the checkpoint's chat template with the request's tools, and the format
        its answer is parsed with. tool_choice "none" renders the tools (none with
        `exclude_tools_when_tool_choice_none`) and parses no calls; "required" or a named function puts the
        start of a `<tool_call>` block at the head of the answer. A structured answer (`response_format`) is all
        grammar from its first token, so a prompt that opened the reasoning closes it, as a forced call does."""
        tools = request.tools or None
        if tools is not None and request.tool_choice == "none":
            rendered = None if self.config.exclude_tools_when_tool_choice_none else tools
            tools = None  # nothing parsed as a call and nothing forced
        else:
            rendered = tools
        text = await self._render_chat(request, rendered)
        tail = text[text.rfind(ASSISTANT_TURN) :]
        in_reasoning = tail.rfind(THINK_START) > tail.rfind(THINK_END)
        prefix = _forced_tool_call(request.tool_choice) if tools is not None else ""
        if (prefix or structured) and in_reasoning:
            prefix = "\n" + THINK_END + "\n\n" + prefix  # a forced call or a structured answer skips the reasoning
        ids = await asyncio.to_thread(self.tokenizer.encode, text + prefix, bool(request.add_special_tokens))
        ids = self.truncated(ids, request)
        self.check_prompt(ids, "messages")
        output_format = OutputFormat(
            reasoning=self.config.reasoning_parser != "none",
            tools={t.function.name: t.function.model_dump() for t in tools}
            if tools is not None and self.config.tool_call_parser != "none" else None,
            in_reasoning=in_reasoning, prefix=prefix, parallel=request.parallel_tool_calls is not False,
        )  # fmt: skip
        return ids, output_format

    async def tokenize(self, request: api.TokenizeCompletionRequest | api.TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: a prompt's ids, or a conversation's as the chat template renders it (with its tools
        and template arguments), without the length check that generation makes."""
        self.check_model(request.model)
        if isinstance(request, api.TokenizeChatRequest):
            problems = api.continuation_problems(request)
            if problems:
                raise APIError(400, problems[0][1], problems[0][0])
            text = await self._render_chat(request, request.tools)
        else:
            self._need_tokenizer("prompt")
            _require_unicode(request.prompt, "prompt")
            text = request.prompt
        ids = await asyncio.to_thread(self.tokenizer.encode, text, request.add_special_tokens)
        strs = [self.tokenizer.backend.id_to_token(i) for i in ids] if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strs}

    async def _render_chat(self, request: api.ChatCompletionRequest | api.TokenizeChatRequest,
                           tools: list[api.Tool] | None) -> str:  # fmt: skip
        """The conversation as the checkpoint's chat template renders it, with `tools`, and the request's generation
        prompt (or its continued last message) and template arguments."""
        self._need_tokenizer("messages")
        kwargs = request.chat_template_kwargs or {}
        reserved = {"messages", "add_generation_prompt", "continue_final_message", "tools"} & kwargs.keys()
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
        kwargs = _template_extras(request) | kwargs
        messages = [m.for_template() for m in request.messages]
        rendered = None if tools is None else [tool.model_dump(exclude_none=True) for tool in tools]
        for param, value in (("messages", messages), ("tools", rendered), ("chat_template_kwargs", kwargs)):
            _require_unicode_within(value, param)
        try:
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, request.add_generation_prompt,
                                           rendered, request.continue_final_message, **kwargs)  # fmt: skip
        except Exception as err:  # the template runs on client data: whatever it raises is the client's
            raise APIError(400, f"messages: {err}", "messages") from None

    async def detokenize(self, request: api.DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        self.check_model(request.model)
        self._need_tokenizer("tokens")
        self.check_in_vocabulary(request.tokens, "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, request.tokens, False)
        return {"prompt": text}

    # ---- parameters --------------------------------------------------------------------------------------
    def generation_params(self, request: api.SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                          default_max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                          grammar: Grammar | None = None, token_filter: TokenFilter | None = None,
                          max_tokens_param: str = "max_tokens") -> GenerationParams:  # fmt: skip
        max_tokens = self._max_tokens(num_prompt_tokens, max_tokens, default_max_tokens, max_tokens_param)
        if logprobs is not None and logprobs > self.config.max_logprobs:
            raise APIError(400, f"at most {self.config.max_logprobs} logprobs per token, got {logprobs}", "logprobs")
        self.check_in_vocabulary(request.stop_token_ids or (), "stop_token_ids", "stop_token_ids")
        params = GenerationParams(
            max_tokens=max_tokens, sampling=self._sampling(request), stop=request.stop_strings(),
            stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, grammar=grammar, include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens, min_tokens=request.min_tokens, token_filter=token_filter,
        )  # fmt: skip
        self._check_min_tokens(params)
        return params

    def _check_min_tokens(self, params: GenerationParams) -> None:
        if params.min_tokens > params.max_tokens:
            raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds the output's max_tokens "
                                f"({params.max_tokens})", "min_tokens")  # fmt: skip
        held = len(params.held_back(self.engine.eos_token_ids)) if params.min_tokens else 0
        if held + len(params.sampling.logit_bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"min_tokens holds back {held} end tokens, which with {len(params.sampling.logit_bias)} "
                                f"logit_bias entries exceed the {MAX_LOGIT_BIAS} a request may have", "min_tokens")  # fmt: skip

    async def grammar(self, request: api.SamplingFields) -> Grammar | None:
        """The compiled grammar of the request's constraint on its answer (`SamplingFields.constraint`: a structured
        response_format, or vLLM's structured_outputs / guided_*), or None. It compiles off the event loop: a
        large schema takes milliseconds."""
        constraint = request.constraint()
        if constraint is None:
            return None
        if self.grammars is None:
            raise APIError(400, f"model {self.config.served_model_name!r} has no tokenizer, which {constraint.param} "
                                "needs", constraint.param)  # fmt: skip
        try:
            grammar = await asyncio.to_thread(self.grammars.compile, constraint.kind, constraint.value)
        except GrammarError as err:
            raise APIError(400, f"{constraint.param}: the constraint cannot be used: {err}", constraint.param) from None
        grammar.param = constraint.param
        return grammar

    async def forced_call_grammar(self, request: api.ChatCompletionRequest) -> Grammar | None:
        """For tool_choice "required" or a named function: the grammar of the answer after the forced head of the
        call (`parsers.tool_call_grammar`), so that it names one of the tools (or the named one) and gives the
        parameters their schemas declare, as vLLM's structured outputs guarantee; None for other requests."""
        if not request.forces_tool_call or not request.tools or self.grammars is None:
            return None
        tools = {tool.function.name: tool.function.model_dump() for tool in request.tools}
        named = request.tool_choice.function.name if isinstance(request.tool_choice, api.NamedToolChoice) else None
        try:
            text = tool_call_grammar(tools, named, parallel=request.parallel_tool_calls is not False)
            grammar = await asyncio.to_thread(self.grammars.grammar, text)
        except GrammarError as err:
            raise APIError(400, f"tools: a parameter schema cannot be used to constrain the forced tool call: {err}",
                           "tools") from None  # fmt: skip
        grammar.param = "tool_choice"
        return grammar

    async def token_filter(self, request: api.SamplingFields) -> TokenFilter | None:
        """vLLM's allowed_token_ids and bad_words as one `TokenFilter`, or None when the request sets neither."""
        if request.allowed_token_ids is None and not request.bad_words:
            return None
        if request.allowed_token_ids is not None:
            self.check_in_vocabulary(request.allowed_token_ids, "allowed_token_ids")
        words = await asyncio.to_thread(self._bad_word_ids, request.bad_words or [])
        try:
            return TokenFilter.build(self.config.vocab_size, request.allowed_token_ids, words)
        except ValueError as err:
            raise APIError(400, str(err), "bad_words") from None

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as vLLM bans it: its token ids alone and after a space (when those differ), leading
        whitespace dropped."""
        if not words:
            return ()
        self._need_tokenizer("bad_words")
        found = []
        for word in words:
            _require_unicode(word, "bad_words")
            if not word.strip():
                raise APIError(400, "bad_words may not hold an empty or all-whitespace word", "bad_words")
            alone, spaced = (tuple(self.tokenizer.encode(prefix + word.lstrip())) for prefix in ("", " "))
            found += [alone] if spaced == alone else [alone, spaced]
        return tuple(found)

    def _max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, default_max_tokens: int,
                    param: str = "max_tokens") -> int:  # fmt: skip
        """The request's max_tokens (sent as `param`), or the default capped by the context left; checked against
        the engine."""
        if max_tokens is None:
            max_tokens = min(default_max_tokens, self.config.max_model_len - num_prompt_tokens)
        try:
            self.engine.check(num_prompt_tokens, max_tokens)
        except RequestRejected as err:
            raise APIError(400, str(err), param, "context_length_exceeded") from None
        return max_tokens

    def _sampling(self, request: api.SamplingFields) -> SamplingParams:
        """OpenAI's defaults for what is unset; a top_k that keeps the whole vocabulary turns top_k off."""
        top_k = request.top_k or 0
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=0 if top_k < 0 or top_k >= self.config.vocab_size else top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            min_p=request.min_p or 0.0,
            seed=secrets.randbits(63) if request.seed is None else request.seed,
            logit_bias=self._logit_bias(request.logit_bias or {}),
            presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        )  # fmt: skip

    def _logit_bias(self, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": value} as (id, value) pairs, checked against the vocabulary; zeros dropped."""
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
        pairs = []
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias key {key[:40]!r} is not a token id", "logit_bias") from None
            if not 0 <= token < self.config.vocab_size:
                raise APIError(400, f"logit_bias token id {token} is outside the vocabulary [0, "
                                    f"{self.config.vocab_size})", "logit_bias")  # fmt: skip
            if value:
                pairs.append((token, float(value)))
        return tuple(pairs)


def _forced_tool_call(tool_choice) -> str:
    """The head of the answer that tool_choice forces: a `<tool_call>` block, with its function when named."""
    if isinstance(tool_choice, api.NamedToolChoice):
        return f"{TOOL_START}\n<function={tool_choice.function.name}>\n"
    return f"{TOOL_START}\n<function=" if tool_choice == "required" else ""


def _template_extras(request: api.ChatCompletionRequest | api.TokenizeChatRequest) -> dict:
    """What the request's reasoning_effort and documents give the chat template (chat_template_kwargs win)."""
    extras = {}
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:
        extras["reasoning_effort"] = effort
        if effort in ("none", "minimal"):
            extras["enable_thinking"] = False
    if getattr(request, "documents", None) is not None:
        extras["documents"] = request.documents
    return extras


def _chat_echo(request: api.ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the text of the last message when it is the assistant's, which the answer then starts
    with; None when nothing is echoed."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant" or last.content is None:
        return None
    return "".join(last.parts())


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def _include_usage(request: api.SamplingFields) -> bool:
    return request.stream_options is not None and request.stream_options.include_usage


def _continuous_usage(request: api.SamplingFields) -> bool:
    """As vLLM: continuous_usage_stats counts only beside include_usage."""
    return _include_usage(request) and request.stream_options.continuous_usage_stats


def _require_unicode_within(value, param: str) -> None:
    """_require_unicode over every string of a JSON-like value (keys too), naming the path of the first bad one:
    `messages[0].content[1].text`."""
    if isinstance(value, str):
        _require_unicode(value, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            _require_unicode_within(key, param)
            _require_unicode_within(item, f"{param}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _require_unicode_within(item, f"{param}[{i}]")


def _require_unicode(text: str, param: str) -> None:
    """JSON's \\u escapes can carry lone UTF-16 surrogates, which are no Unicode text: the tokenizer refuses them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{param} is not valid Unicode: a lone surrogate {text[err.start]!r} at index "
                            f"{err.start}", param) from None  # fmt: skip
