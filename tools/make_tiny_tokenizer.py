"""Build the tiny byte-level BPE tokenizer shipped in `qwen35_jax/assets/tiny/`.

The tokenizer is trained with the `tokenizers` library on a small English corpus written below, so the
output is reproducible from this file alone. It mirrors the structure of the Qwen3.5 tokenizer (NFC
normalizer, Qwen-style split regex with single digits, byte-level pre-tokenizer and decoder, ChatML
specials) at a vocabulary small enough for the tiny test model (vocab_size 512).

Usage:
    python tools/make_tiny_tokenizer.py [--out qwen35_jax/assets/tiny] [--check]

`--check` rebuilds in memory and exits non-zero if the files on disk differ (used to verify determinism).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 4096

# (content, special): ids are assigned in this order, starting at 0. The think markers are added tokens
# that are not "special", as in Qwen's own tokenizer, so decode(skip_special_tokens=True) keeps them.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
)

# The pre-tokenizer split pattern used by Qwen3.5 (see the reference notes, section 6): letters with marks,
# single digits, punctuation runs, newlines and whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages and messages[0].role == 'system' %}\n"
    "{{- messages[0].content + '\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- 'You can call these functions. Their signatures are listed below.\\n<tools>' }}\n"
    "{%- for tool in tools %}\n"
    "{{- '\\n' + (tool | tojson) }}\n"
    "{%- endfor %}\n"
    "{{- '\\n</tools>\\nTo call one, reply with <tool_call></tool_call> blocks.<|im_end|>\\n' }}\n"
    "{%- elif messages and messages[0].role == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(last_user=-1) %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' %}\n"
    "{%- if not loop.first %}"
    "{{- raise_exception('A system message is only allowed first.') }}"
    "{%- endif %}\n"
    "{%- elif message.role == 'user' %}\n"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if loop.index0 > ns.last_user and message.reasoning_content is defined"
    " and message.reasoning_content %}\n"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- message.content }}\n"
    "{%- if message.tool_calls %}\n"
    "{%- for call in message.tool_calls %}\n"
    "{%- set fn = call.function if call.function is defined else call %}\n"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "{{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}\n"
    "{%- set args = fn.arguments if fn.arguments is mapping else {} %}\n"
    "{%- for key, value in args.items() %}\n"
    "{{- '<parameter=' + key + '>\\n' }}"
    "{{- value if value is string else (value | tojson) }}"
    "{{- '\\n</parameter>\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '</function>\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- elif enable_thinking is defined and enable_thinking %}\n"
    "{{- '<think>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)

# A few KB of varied text: prose, dialogue, numbers, punctuation, code, markup and chat-style turns.
CORPUS = r"""
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was a bright cold day in April, and the clocks were striking thirteen.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
How much wood would a woodchuck chuck if a woodchuck could chuck wood?
I think, therefore I am. To be, or not to be: that is the question.
The weather today is sunny with a high of 24 degrees and a low of 13 degrees.
Please remember to bring your passport, your ticket, and a pen for the forms.
Alice asked Bob whether he had finished the report; Bob said he'd send it by Friday.
"Where are you going?" she asked. "To the library," he replied, "I need a book on history."
They're sure we've seen it, but I'm not; you'll see it's different, and we'd better check.
Hello! Hi there. Good morning, good afternoon, and good evening. Thank you very much.
What is the capital of France? The capital of France is Paris. What is two plus two? Four.
Can you help me write a short poem about the ocean? Of course! Here is a poem about the sea.
The model answered the question correctly, then explained its reasoning step by step.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 512 1024 2048 4096 65536 3.14159 2.71828 -7 +12.
Dates and times: 2024-01-15, 12:30:45, 1999/12/31, 08:00 AM, 11:59 PM, Q3 2025.
Prices: $19.99, 5 EUR, 100%, 3/4 cup, 1,000,000 people, #1 item, 50% off, 2x faster.
Punctuation: (parentheses) [brackets] {braces} <angles> "quotes" 'single' -- dashes ... ellipsis !?;:
Emails and links: user@example.com, https://example.org/path?query=1&x=2, file_name.txt
def add(a, b):
    return a + b

class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5

for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

import json
data = {"name": "tiny", "size": 512, "tags": ["test", "model"], "ok": true, "none": null}
print(json.dumps(data, indent=2))

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message.length;
}

SELECT id, name FROM users WHERE age >= 18 ORDER BY name ASC LIMIT 10;
x = [1, 2, 3]; y = {k: v for k, v in zip("abc", x)}; z = x[::-1]
if (a && b || !c) { return -1; } else { return 0; }
# Heading
## Subheading
- first item
- second item
* bold * and _italic_ text, `inline code`, and > a quote.
<|im_start|>user
What time is it?<|im_end|>
<|im_start|>assistant
<think>
The user wants the time. I do not have a clock, so I should say so.
</think>

I cannot see a clock, but you can check the time on your device.<|im_end|>
<|im_start|>user
Tell me a fact about the moon.<|im_end|>
<|im_start|>assistant
The moon is about 384,400 kilometers from the earth, and it orbits once every 27 days.<|im_end|>
<|endoftext|>
Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.
The library opens at nine in the morning and closes at six in the evening on weekdays.
Every student should read the instructions carefully before starting the examination.
The train was late again, so we walked along the river and watched the boats.
Machine learning models learn patterns from data; larger models often need more data.
The engine serves many requests at once by batching them together on the accelerator.
Tokens are generated one at a time, and each new token depends on all of the previous ones.
The cat sat on the mat. The dog sat on the log. The bird sang in the tree.
In the beginning there was nothing, and then there was a great deal of something.
Some words: apple, banana, cherry, dragon, elephant, forest, garden, harbor, island, jungle.
More words: kitchen, lemon, mountain, notebook, orange, planet, quiet, river, summer, thunder.
And more: umbrella, valley, window, xylophone, yellow, zebra, morning, evening, network, system.
Non-ASCII: café, naïve, résumé, über, jalapeño, 東京, 你好, こんにちは, 😀, 🚀, ½, €.
"""


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[content for content, _ in ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Train on the corpus line by line (newlines kept), in a fixed order.
    tok.train_from_iterator([line + "\n" for line in CORPUS.split("\n")], trainer=trainer)

    # The trainer registers every added token as special; mark the think markers as non-special.
    spec = json.loads(tok.to_str())
    flags = dict(ADDED_TOKENS)
    for entry in spec["added_tokens"]:
        entry["special"] = flags[entry["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    for i, (content, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(content) != i:
            raise RuntimeError(f"{content!r} got id {tok.token_to_id(content)}, expected {i}")
    if tok.get_vocab_size(with_added_tokens=True) > VOCAB_SIZE:
        raise RuntimeError(f"vocab too large: {tok.get_vocab_size(with_added_tokens=True)}")
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(ADDED_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "unk_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def render_files() -> dict[str, str]:
    tok = build_tokenizer()
    tokenizer_json = json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"
    config_json = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config_json}


def main(argv: list[str] | None = None) -> int:
    default_out = Path(__file__).resolve().parent.parent / "qwen35_jax" / "assets" / "tiny"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    args = parser.parse_args(argv)

    files = render_files()
    if args.check:
        stale = [
            n
            for n, text in files.items()
            if not (args.out / n).is_file() or (args.out / n).read_text(encoding="utf-8") != text
        ]
        if stale:
            print(f"out of date in {args.out}: {', '.join(stale)}", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
    vocab = json.loads(files["tokenizer.json"])
    n = len(vocab["model"]["vocab"])
    print(f"wrote {args.out} (vocab {n}, merges {len(vocab['model']['merges'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
