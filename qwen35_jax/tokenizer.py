"""Tokenizer layer: encode/decode over a HF `tokenizer.json`, chat templates, streaming detokenization and
stop strings.

- `Tokenizer` wraps a `tokenizers.Tokenizer` (byte-level BPE for Qwen3.5) and renders the checkpoint's
  jinja chat template in a sandbox, with the same environment settings HF uses so prompts match HF.
- `IncrementalDetokenizer` turns a stream of generated ids into text without ever emitting half of a
  multi-byte UTF-8 character, decoding only a short window of recent ids per step.
- `StopStringMatcher` cuts a text stream at the first stop string, holding back any tail that might
  still grow into one.

The tiny tokenizer for tests and random-weight models lives in `assets/tiny/` (see `tiny_tokenizer_dir`);
it is built by `tools/make_tiny_tokenizer.py`.
"""

from __future__ import annotations

import datetime
import json
import numbers
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant", "tool")
# Tokens that end a turn or a document; `eos_token_ids` holds the ids of those the vocabulary has.
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_PAD_TOKEN = "<|endoftext|>"

# Used when a checkpoint ships no chat template: plain ChatML.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_REPLACEMENT = "\ufffd"


def tiny_tokenizer_dir() -> Path:
    """Folder of the built-in tiny tokenizer (vocab <= 512), for tests and random-weight models."""
    return Path(__file__).resolve().parent / "assets" / "tiny"


def _token_content(value: Any) -> str | None:
    """A token named in tokenizer_config.json: a plain string or an AddedToken dict with 'content'."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _select_template(value: Any) -> str | None:
    """`chat_template` from tokenizer_config.json: a string, or a list of {name, template}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        for template in named.values():
            if isinstance(template, str):
                return template
    return None


# ---------------------------------------------------------------------------------------------------------
# Chat template environment


class _TemplateRaise(jinja2.exceptions.TemplateError):
    """Raised by `raise_exception(...)` inside a chat template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaise(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # Not HTML-escaped (unlike jinja2's built-in tojson): prompts are plain text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---------------------------------------------------------------------------------------------------------
# Message validation


def _flatten_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}.content[{j}] must be an object, got {type(part).__name__}")
            if part.get("type") != "text":
                raise ValueError(f"{where}.content[{j}] has type {part.get('type')!r}; only 'text' parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def _normalize_tool_calls(tool_calls: Any, where: str) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            raise ValueError(f"{where}.tool_calls[{j}] must be an object")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, Mapping):
            fn = dict(fn)
            # OpenAI sends arguments as a JSON string; templates iterate over them as a mapping.
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    parsed = None
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
            call["function"] = fn
        out.append(call)
    return out


def _cut_after_final_message(text: str, final: dict) -> str:
    """`text` up to the end of the final message's content, the last place it occurs: as the client wrote it, or
    stripped of outer whitespace where the template trimmed it."""
    if not final["content"].strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    for content in (final["content"], final["content"].strip()):
        end = text.rfind(content)
        if end >= 0:
            return text[: end + len(content)]
    raise ValueError("continue_final_message: the chat template does not render the final message's text")


def normalize_messages(messages: Any) -> list[dict]:
    """Check chat messages and return copies with text-only string content.

    Each message is a dict with `role` in system/user/assistant/tool and `content` a string or a list of
    `{"type": "text", "text": ...}` parts (joined with newlines). An assistant message may have no content
    (None or missing, e.g. with `tool_calls`). Other keys (name, tool_calls, tool_call_id,
    reasoning_content, ...) are passed through; `tool_calls[].function.arguments` given as a JSON string is
    parsed into a dict. Raises ValueError on anything else.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        msg = dict(message)
        content = message.get("content")
        if content is None and role == "assistant":
            msg["content"] = ""
        elif content is None:
            raise ValueError(f"{where} ({role}) has no content")
        else:
            msg["content"] = _flatten_content(content, where)
        if msg.get("tool_calls") is not None:
            msg["tool_calls"] = _normalize_tool_calls(msg["tool_calls"], where)
        for key in ("reasoning_content", "name", "tool_call_id"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise ValueError(f"{where}.{key} must be a string")
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """A `tokenizers` tokenizer plus the chat template and special-token facts the engine needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        config: Mapping[str, Any] | None = None,
        name_or_path: str | None = None,
    ):
        self.backend = backend
        self.config = dict(config or {})
        self.name_or_path = name_or_path
        self.chat_template_is_fallback = chat_template is None
        self.chat_template = CHATML_TEMPLATE if chat_template is None else chat_template
        self.model_max_length = self.config.get("model_max_length")

        eos = [self.token_id(t) for t in EOS_TOKENS]
        configured = _token_content(self.config.get("eos_token"))
        if configured is not None:
            eos.append(self.token_id(configured))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))

        pad = _token_content(self.config.get("pad_token"))
        pad_id = self.token_id(pad) if pad is not None else None
        self.pad_token_id: int | None = pad_id if pad_id is not None else self.token_id(DEFAULT_PAD_TOKEN)

        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template from a checkpoint folder.

        The template comes from `chat_template.jinja` if present, else `tokenizer_config.json`'s
        `chat_template` (a string, or a list of {name, template} from which "default" is taken), else the
        built-in ChatML template is used (`chat_template_is_fallback` is then True).
        """
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} at {tokenizer_file}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config: dict[str, Any] = {}
        if (folder / CONFIG_FILE).is_file():
            config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError(f"{folder / CONFIG_FILE} is not a JSON object")
        template = None
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            template = _select_template(config.get("chat_template"))
        return cls(backend, chat_template=template, config=config, name_or_path=str(folder))

    @classmethod
    def tiny(cls) -> Tokenizer:
        """The built-in tiny tokenizer (vocab 512)."""
        return cls.from_dir(tiny_tokenizer_dir())

    # -- vocabulary ---------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (model vocab plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        """Id of a token string (as stored in the vocab, e.g. '<|im_end|>'), or None if unknown."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # -- encode / decode ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids. add_special_tokens: also those
        the tokenizer's post-processor adds (a BOS, for tokenizers that have one; Qwen's adds none)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the vocabulary does not have (e.g. embedding padding) decode to nothing."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError("token ids must be non-negative")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        try:
            return _make_environment().from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template of {self.name_or_path} does not compile: {e}") from e

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render the chat template to a prompt string (encode it with `encode`).

        continue_final_message: the prompt ends with the last message's text, its turn left open, so that the
        model continues it (an assistant answer the client started); as HF's, the rendered conversation is cut
        right after the last occurrence of that text. Extra keyword arguments (e.g. `enable_thinking=False`) are
        passed to the template. Raises ValueError for invalid messages or when the template itself rejects the
        conversation.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message, so add_generation_prompt must be false"
            )
        context: dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = _token_content(self.config.get(key))
            if value is not None:
                context[key] = value
        context.update(kwargs)
        context["messages"] = normalize_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        if tools is not None:
            context["tools"] = tools
        try:
            text = self._compiled_template.render(**context)
        except _TemplateRaise as e:
            raise ValueError(f"chat template rejected the conversation: {e}") from e
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
        return _cut_after_final_message(text, context["messages"][-1]) if continue_final_message else text

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs):
        """`encode(apply_chat_template(...))`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------------------
# Streaming detokenization


class IncrementalDetokenizer:
    """Streams text for a growing sequence of generated ids.

    The concatenation of everything `push` and `flush` return equals `tokenizer.decode(all_ids)`. Text that
    ends in U+FFFD (a multi-byte character split across tokens) is held back until it completes.

    Each id goes through the tokenizers library's `DecodeStream`, which does the prefix/suffix decode of a
    short window in Rust (~0.7 us a token against ~4 us for the same walk in Python). Beside it this keeps
    its own short window: the last few emitted ids (decode context) and the ids not yet emitted, for what the
    stream cannot do: `flush` the held text, and emit part of a long run that keeps ending in U+FFFD.
    """

    # After this many unread ids are held, look for an earlier safe split (a run of invalid bytes can end
    # in U+FFFD for a long time without ever completing).
    MAX_HELD = 8
    CONTEXT = 4  # emitted ids kept in the window as decode context

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._window: list[int] = []
        self._read = 0  # window[:read] is emitted context, window[read:] is pending

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one or more ids; return the newly completed text (possibly empty)."""
        if type(ids) is int or isinstance(ids, numbers.Integral):  # the first test is the fast path: ABCs are slow
            return self._push_one(int(ids))
        return "".join([self._push_one(int(i)) for i in ids])

    def _push_one(self, i: int) -> str:
        if i < 0:
            raise ValueError("token ids must be non-negative")
        backend = self.tokenizer.backend
        # Ids that decode to nothing anywhere are dropped so they cannot grow the window.
        if i in self._skip_ids or backend.id_to_token(i) is None:
            return ""
        self._window.append(i)
        text = self._stream.step(backend, i)
        if text is not None:
            self._emitted(len(self._window))
            return text
        if len(self._window) - self._read > self.MAX_HELD:
            return self._emit_through_safe_split()
        return ""

    def _emitted(self, split: int) -> None:
        """window[:split] is emitted; keep its last CONTEXT ids as context."""
        if split > self.CONTEXT:
            del self._window[: split - self.CONTEXT]
            split = self.CONTEXT
        self._read = split

    def _emit_through_safe_split(self) -> str:
        # A split k is safe when decoding both halves separately gives the same text as decoding the
        # whole window: the bytes before k then end on a character boundary, or in bytes that can no
        # longer be completed. The stream starts again at the split, fed the held ids after it: its text
        # does not depend on what precedes the split (a stream seeded with that context would emit the
        # context again when it holds invalid bytes).
        window, prefix = self._window, self._decode(self._window[: self._read])
        text = self._decode(window)
        for k in range(len(window) - 1, self._read, -1):
            head = self._decode(window[:k])
            tail = self._decode(window[k:])
            if tail and len(head) > len(prefix) and head + tail == text:
                out, held = head[len(prefix) :], window[k:]
                self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)
                self._emitted(k)
                for j, i in enumerate(held):
                    more = self._stream.step(self.tokenizer.backend, i)
                    if more is not None:  # emitted through held[j]: the ids after it stay held
                        out += more
                        self._emitted(len(self._window) - (len(held) - j - 1))
                return out
        return ""

    def flush(self) -> str:
        """Return all held text, including an incomplete trailing character (as U+FFFD), and reset."""
        text = self._decode(self._window)
        out = text[len(self._decode(self._window[: self._read])) :]
        self._window = []
        self._read = 0
        self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return out


# ---------------------------------------------------------------------------------------------------------
# Stop strings


class StopStringMatcher:
    """Cuts a text stream at the first stop string to appear (the stop string itself is emitted only with
    `include`, vLLM's include_stop_str_in_output).

    "First" means the one whose end comes first, as if the text arrived one character at a time; of
    several ending at the same place, the longest. Chunking therefore never changes the result.

    `push(text)` returns `(emit, stopped)`: text that is safe to send now, and whether a stop string was
    found (after which everything else is dropped). A tail that could be the start of a stop string is
    held back until it is decided; `flush()` returns it at the end of the stream.
    """

    def __init__(self, stops: Iterable[str], include: bool = False):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include
        if any(not isinstance(s, str) for s in self.stops):
            raise TypeError("stop strings must be str")
        self._prefixes = frozenset(s[:n] for s in self.stops for n in range(1, len(s)))
        self._max_held = max((len(s) - 1 for s in self.stops), default=0)
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buffer = self._buffer + text
        # The stop string that completes first wins (the longest one if several end at the same place),
        # so the result does not depend on how the text was split into chunks.
        best: tuple[int, int] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best):
                best, self.matched = (at + len(stop), at), stop
        if best is not None:
            self._buffer = ""
            self.stopped = True
            return buffer[: best[0] if self.include else best[1]], True
        held = 0
        for n in range(min(self._max_held, len(buffer)), 0, -1):
            if buffer[-n:] in self._prefixes:
                held = n
                break
        self._buffer = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        """The held tail (no stop string followed it); empty once stopped."""
        out, self._buffer = self._buffer, ""
        return "" if self.stopped else out
