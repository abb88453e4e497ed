"""`ServerConfig`: what the HTTP side of `serve` is told about the model and its limits."""

from __future__ import annotations

import dataclasses

from qwen35_jax.serving.protocol import MAX_TOP_LOGPROBS


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_model_len: int
    vocab_size: int  # of the model's embedding: token ids must be below it
    api_key: str | None = None
    # Requests beyond max_batch running + max_queue waiting get 429; None = no limit.
    max_queue: int | None = 1024
    max_body_bytes: int = 4 << 20
    default_completion_max_tokens: int = 16  # as OpenAI's completions API
    # Chat without max_tokens gets the rest of the context, capped here: the scheduler reserves every
    # page a request may need at admission, so an uncapped default would make every chat request hold
    # a full-context reservation.
    default_chat_max_tokens: int = 4096
    max_logprobs: int = MAX_TOP_LOGPROBS
    # How chat answers are parsed (serving/parsers.py): Qwen3's <think> reasoning, Qwen3-Coder's <tool_call> blocks.
    reasoning_parser: str = "qwen3"
    tool_call_parser: str = "qwen3_coder"
    # tool_choice "none": the tools stay in the prompt (the model knows them, as vLLM renders them) unless this is
    # set, and the answer is never parsed for calls either way.
    exclude_tools_when_tool_choice_none: bool = False
    # The engine has prompt-logprobs programs (--prompt-logprobs-chunk): echo with logprobs and prompt_logprobs work.
    prompt_logprobs: bool = False
    model_root: str | None = None  # where the model came from (--model): the model card's `root`, as vLLM's
    # CORS, as vLLM's flags set it: browsers may call the API from any origin by default.
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
