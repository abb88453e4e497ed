"""Grammar-library measurement on the host CPU: llguidance and xgrammar at a Qwen3.5-size vocabulary.

    .venv/bin/python tools/bench_grammar.py --library llguidance --json llguidance.json
    /path/to/venv-with-xgrammar/bin/python tools/bench_grammar.py --library xgrammar --json xgrammar.json

For each library: the tokenizer set-up, the compile of each schema (cold: no cache), and the per-step token
mask over a document that satisfies the schema, walked token by token as the engine walks a request (mask,
then accept the token the model picked). Both libraries build compact JSON (", " and ": " separators, no free
whitespace), the form serving/structured_output.py asks llguidance for.

No Qwen3.5 tokenizer can be fetched here, so the vocabulary is a byte-level BPE at Qwen3.5's vocabulary size,
trained with Qwen3.5's split pattern on the Python sources of the running interpreter's site-packages
(cached under ~/.cache/qwen35_jax). Its tokens are code-shaped rather than multilingual; the mask cost depends
mostly on the vocabulary size and the token trie, which this reproduces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from make_tiny_tokenizer import SPLIT_PATTERN
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

QWEN35_VOCAB = 248320
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS_BYTES = 256 << 20

SCHEMAS = {
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 64},
                    "email": {"type": "string", "format": "email"},
                    "vip": {"type": "boolean"},
                },
                "required": ["name", "email", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 20,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                        "price": {"type": "number", "minimum": 0},
                    },
                    "required": ["sku", "quantity", "price"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "notes": {"type": ["string", "null"]},
        },
        "required": ["order_id", "customer", "items", "status", "notes"],
        "additionalProperties": False,
    },
    "json_object": {"type": "object"},
}

DOCUMENTS = {
    "order": {
        "order_id": "ABC-123456",
        "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True},
        "items": [
            {"sku": "widget-blue-large", "quantity": 3, "price": 19.99},
            {"sku": "gadget-red", "quantity": 12, "price": 4.5},
            {"sku": "gizmo", "quantity": 1, "price": 250},
        ],
        "status": "shipped",
        "notes": "Leave the parcel at the front door; ring twice. Fragile: contains glass.",
    },
}
DOCUMENTS["json_object"] = DOCUMENTS["order"]


def corpus(limit: int):
    """Python sources of site-packages, sorted, up to `limit` bytes, one file at a time."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        if total > limit:
            return
        yield text


def large_tokenizer(vocab_size: int) -> Tokenizer:
    cached = Path.home() / ".cache" / "qwen35_jax" / f"bench_tokenizer_{vocab_size}.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    start = time.perf_counter()
    tok.train_from_iterator(corpus(CORPUS_BYTES), trainer=trainer)
    print(f"trained a {tok.get_vocab_size()}-token BPE in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(cached))
    return tok


def summary(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"steps": len(ms), "mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], "max_ms": ms[-1]}  # fmt: skip


def document_tokens(tok: Tokenizer, name: str) -> list[int]:
    text = json.dumps(DOCUMENTS[name], separators=(", ", ": "))
    return tok.encode(text, add_special_tokens=False).ids


class Llguidance:
    def __init__(self, tok: Tokenizer, vocab_size: int, eos: int, threads: int):
        import llguidance
        import llguidance.numpy

        self.ll, self.np = llguidance, llguidance.numpy
        self.tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        mask = self.np.allocate_token_bitmask(1, self.vocab_size)
        seconds = []
        for token in tokens:
            start = time.perf_counter()
            self.np.fill_next_token_bitmask(matcher, mask, 0)
            seconds.append(time.perf_counter() - start)
            assert (mask[0, token // 32] >> (token % 32)) & 1, f"token {token} masked out"
            assert matcher.consume_token(token), matcher.get_error()
        return seconds


class Xgrammar:
    def __init__(self, tok: Tokenizer, vocab_size: int, eos: int, threads: int):
        import xgrammar

        self.xgr = xgrammar
        vocab = tok.get_vocab()
        encoded = [""] * len(vocab)
        for token, i in vocab.items():
            encoded[i] = token
        self.info = xgrammar.TokenizerInfo(encoded, vocab_type=xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                           stop_token_ids=[eos], add_prefix_space=False)  # fmt: skip
        self.threads = threads
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self.xgr.GrammarMatcher(compiled)

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        seconds = []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            seconds.append(time.perf_counter() - start)
            assert (int(mask[0, token // 32]) >> (token % 32)) & 1, f"token {token} masked out"
            assert matcher.accept_token(token)
        return seconds


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


def measure(library: str, vocab_size: int, threads: int, repeats: int) -> dict:
    tok = large_tokenizer(vocab_size)
    eos = tok.token_to_id("<|im_end|>")
    start = time.perf_counter()
    backend = LIBRARIES[library](tok, vocab_size, eos, threads)
    result = {"library": library, "tokenizer_vocab": tok.get_vocab_size(), "mask_vocab": vocab_size,
              "tokenizer_setup_s": time.perf_counter() - start, "schemas": {}}  # fmt: skip
    for name, schema in SCHEMAS.items():
        tokens = document_tokens(tok, name)
        compiles, steps = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            matcher = backend.compile(schema)
            compiles.append(time.perf_counter() - start)
            steps += backend.walk(matcher, tokens)
        result["schemas"][name] = {"compile_ms": [c * 1e3 for c in compiles], "mask": summary(steps),
                                   "document_tokens": len(tokens)}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=sorted(LIBRARIES), required=True)
    parser.add_argument("--vocab", type=int, default=QWEN35_VOCAB, help="mask width and BPE target size")
    parser.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.library, args.vocab, args.threads, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
