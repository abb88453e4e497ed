"""Structured output: a request's constraint on its answer as a grammar over the vocabulary, walked token by token.

The constraint is OpenAI's `response_format` (a JSON schema or any JSON object) or vLLM's `structured_outputs`
(also a regular expression, a list of choices or a grammar, in Lark or in GBNF; its older `guided_*` names too).
llguidance (docs/structured_output.md says why this library) compiles it against the served
tokenizer into a matcher that says, before each token, which tokens may come next. The HTTP side compiles
(`GrammarCompiler`, off the event loop, so a bad schema is a 400 before anything is queued); the compiled
`Grammar` is never advanced, and each engine request walks its own `GrammarState` copy of it on the engine
thread. The engine hands a state's `mask` to the sampler row program, which keeps only the allowed tokens
before the greedy or sampled pick (device_sampling.py), and `accept`s the token that comes back.

Masks are packed as llguidance writes them: [ceil(vocab / 32)] int32 words, token t allowed when bit t % 32
of word t // 32 is set (`device_sampling.pack_mask` is the host form of the layout).

JSON is compact: ", " and ": " between items and keys, and no other whitespace. Free whitespace is a lexeme
without an end, so a model can spend every token on it, and the grammar would never close.
"""

from __future__ import annotations

import json
import logging
import re
import time

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from qwen35_jax.serving.device_sampling import mask_words
from qwen35_jax.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
log = logging.getLogger(__name__)

# Matcher errors go to clients: keep the grammar and parser state out of them.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A schema that cannot be compiled; the message says why."""


class GrammarCompiler:
    """The served tokenizer as llguidance sees it, and the compile of each request's schema against it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | frozenset[int]):
        # vocab_size is the model's: ids past the tokenizer's (embedding padding) are never allowed.
        self.vocab_size = vocab_size
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids))  # fmt: skip
        log.info("structured output: the tokenizer's token trie for llguidance took %.2fs", time.perf_counter() - start)

    def json_schema(self, schema: dict | str) -> Grammar:
        """Raises GrammarError for a schema llguidance cannot compile (invalid, or a feature it lacks); a string is
        the schema as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise GrammarError(f"the schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema is an object")
        return self._compile(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))

    def json_object(self, _: object = None) -> Grammar:
        return self.json_schema(ANY_JSON_OBJECT)

    def regex(self, pattern: str) -> Grammar:
        """The whole answer matches `pattern` (llguidance's syntax: Rust's regex crate's)."""
        return self._compile(lambda: llguidance.LLMatcher.grammar_from_regex(pattern))

    def choice(self, choices: list[str]) -> Grammar:
        """The answer is one of `choices`, exactly."""
        return self.regex("(" + "|".join(re.escape(choice) for choice in choices) + ")")

    def grammar(self, grammar: str) -> Grammar:
        """The answer is a sentence of a grammar: Lark (llguidance's dialect, which starts at `start`) or GBNF, the
        EBNF of llama.cpp and xgrammar (`root ::= ...`), which vLLM's default backend takes. llguidance tells them
        apart (a `start:` rule or a `%llguidance` line is Lark) and rewrites GBNF as Lark."""
        return self._compile(lambda: llguidance.LLMatcher.grammar_from_lark(any_to_lark(grammar)))

    def compile(self, kind: str, value) -> Grammar:
        """The grammar of a `protocol.Constraint`'s kind and value."""
        build = {"json_schema": self.json_schema, "json_object": self.json_object, "regex": self.regex,
                 "choice": self.choice, "grammar": self.grammar}[kind]  # fmt: skip
        return build(value)

    def _compile(self, grammar_text) -> Grammar:
        try:
            grammar = grammar_text()
        except (ValueError, GbnfToLarkError) as err:
            raise GrammarError(_first_line(str(err))) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return Grammar(matcher, mask_words(self.vocab_size))


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "llguidance gave no reason"


class Grammar:
    """A compiled grammar at its start, shared by the choices of one request and never advanced itself. `param`
    names the request parameter it came from, for the error of a walk that fails."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, param: str = "response_format"):
        """Raises GrammarError when the grammar cannot even start (a schema that only refers to itself, say)."""
        self.param = param
        self._matcher = matcher
        self._first_mask = np.zeros((1, words), np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, self._first_mask, 0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        if not self._first_mask.any():
            raise GrammarError("the grammar admits no answer")

    def start(self) -> GrammarState:
        """A walk of its own for one engine request (copying a matcher costs under a microsecond)."""
        return GrammarState(self._matcher.deep_copy(), self._first_mask.copy(), self.param)


class GrammarState:
    """One request's position in its grammar; owned by the engine thread.

    `mask` is the set of tokens allowed next. `accept` moves past the token the step picked and computes the
    next mask at once: the engine calls it while the device runs the step after, so the mask is ready
    when the request's next row is launched."""

    def __init__(self, matcher: llguidance.LLMatcher, mask: np.ndarray, param: str = "response_format"):
        self.param = param  # the request parameter the grammar came from
        self._matcher = matcher
        self._mask = mask  # [1, words] int32, the layout llguidance.numpy fills
        self._dead_end = False  # not finished, yet no token may follow: a sampler row would pick from none

    @property
    def mask(self) -> np.ndarray:
        """[words] int32: the packed mask of the tokens allowed next."""
        return self._mask[0]

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes no more tokens (an EOS it allowed also completes it)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        if self._dead_end:
            return "the grammar allows no next token"
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else None

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar refused it or failed (then `error` says why)."""
        if not self._matcher.consume_token(token):
            return False
        if not self.finished:
            llguidance.numpy.fill_next_token_bitmask(self._matcher, self._mask, 0)
            self._dead_end = not self._mask.any()
        return not self._matcher.is_error() and not self._dead_end
