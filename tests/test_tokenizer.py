"""Tokenizer layer tests (CPU, fast): the tiny tokenizer asset, encode/decode, chat templates, streaming
detokenization and stop strings."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from qwen35_jax.tokenizer import (
    CHATML_TEMPLATE,
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
    tiny_tokenizer_dir,
)

REPO = Path(__file__).resolve().parent.parent
SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<think>": 3, "</think>": 4}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.tiny()


def _load_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_tokenizer", REPO / "tools" / "make_tiny_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the tiny asset ----------------------------------------------------------------------------------------


def test_tiny_asset_matches_generator_output():
    files = _load_tool().render_files()
    for name, text in files.items():
        assert (tiny_tokenizer_dir() / name).read_text(encoding="utf-8") == text, f"{name} is stale"


def test_tiny_vocab_and_special_ids(tok):
    assert tok.vocab_size <= 512
    assert tok.vocab_size == 512  # 5 specials + 256 bytes + 251 merges
    for token, i in SPECIALS.items():
        assert tok.token_id(token) == i
        assert tok.id_to_token(i) == token
    assert tok.token_id("<|no_such_token|>") is None
    assert tok.eos_token_ids == (2, 0)
    assert tok.eos_token_id == 2
    assert tok.pad_token_id == 0
    assert tok.special_token_ids == {0, 1, 2}  # the think markers are added but not special
    assert tok.model_max_length == 4096
    # every byte is reachable, so any text can be encoded
    assert all(tok.vocab_size > i for i in tok.encode(bytes(range(32, 127)).decode()))


# --- encode / decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def f(x):\n    return x ** 2  # square\n\n\ttabs\r\nand CRLF",
        "café naïve über 東京 你好 こんにちは 😀🚀 👩‍👩‍👧 ½ € \u00a0nbsp",
        "",
        " leading and trailing spaces  ",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_multibyte_characters_use_byte_tokens(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji is not in the tiny vocab, so it is split into byte tokens
    assert tok.decode(ids) == "😀"
    assert tok.decode(ids[:-1]).endswith("\ufffd")


def test_special_tokens_in_text(tok):
    text = "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\nok<|endoftext|>"
    ids = tok.encode(text)
    assert ids[0] == 1
    assert ids.count(2) == 1 and ids.count(3) == 1 and ids.count(4) == 1 and ids[-1] == 0
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhi\n<think>\nhmm\n</think>\n\nok"


def test_encode_adds_no_special_tokens_and_splits_digits(tok):
    ids = tok.encode("hi 12345")
    assert not set(ids) & {0, 1, 2}
    digits = tok.encode("12345")
    assert [tok.decode([i]) for i in digits] == list("12345")


def test_nfc_normalization(tok):
    assert tok.decode(tok.encode("e\u0301")) == "\u00e9"


def test_decode_ignores_unknown_ids_and_rejects_negative(tok):
    ids = tok.encode("abc")
    assert tok.decode([ids[0], 10_000, *ids[1:]]) == "abc"
    with pytest.raises(ValueError):
        tok.decode([-1])


# --- loading -----------------------------------------------------------------------------------------------


def test_missing_folder_raises_file_not_found(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        Tokenizer.from_dir(missing)
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(missing)


def _copy_tokenizer(tmp_path: Path, config: dict | None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tiny_tokenizer_dir() / "tokenizer.json", folder / "tokenizer.json")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config", [None, {"eos_token": "<|im_end|>"}, {"chat_template": None}])
def test_chatml_fallback_without_template(tmp_path, config):
    t = Tokenizer.from_dir(_copy_tokenizer(tmp_path, config))
    assert t.chat_template_is_fallback
    assert t.chat_template == CHATML_TEMPLATE
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.apply_chat_template(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.apply_chat_template(messages, add_generation_prompt=False).endswith("U<|im_end|>\n")
    assert t.eos_token_ids == (2, 0) and t.pad_token_id == 0


def test_template_from_list_and_from_jinja_file(tmp_path):
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
        ]
    }
    folder = _copy_tokenizer(tmp_path, config)
    t = Tokenizer.from_dir(folder)
    assert not t.chat_template_is_fallback
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT x"
    (folder / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE 1"


def test_template_environment(tmp_path):
    template = (
        "{{ messages[0].content | tojson }} {{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=True) }} {{ foo }}"
        "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}[{{ m.role }}]{% endfor %}"
        "{{ eos_token }}"
    )
    t = Tokenizer.from_dir(_copy_tokenizer(tmp_path, {"chat_template": template, "eos_token": "<|im_end|>"}))
    messages = [{"role": "user", "content": "<é>"}, {"role": "assistant", "content": "a"}]
    assert t.apply_chat_template(messages, foo="bar") == '"<é>" {"a": [1, 2], "b": 1} bar[user]<|im_end|>'
    # HF's whitespace handling: trim_blocks and lstrip_blocks
    (tmp_path / "w").mkdir()
    ws = Tokenizer.from_dir(
        _copy_tokenizer(tmp_path / "w", {"chat_template": "A\n  {% if true %}\nB\n  {% endif %}\nC"})
    )
    assert ws.apply_chat_template(messages) == "A\nB\nC"
    (tmp_path / "s").mkdir()
    sandbox = Tokenizer.from_dir(_copy_tokenizer(tmp_path / "s", {"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(ValueError):  # the immutable sandbox forbids mutating the messages
        sandbox.apply_chat_template(messages)


# --- chat template of the tiny tokenizer -------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": [{"type": "text", "text": "Add 2 and 3."}]},
]
EXPECTED = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello. How can I help?<|im_end|>\n"
    "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_exact(tok):
    assert not tok.chat_template_is_fallback
    assert tok.apply_chat_template(CONVERSATION) == EXPECTED
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == EXPECTED.removesuffix(
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(CONVERSATION, enable_thinking=False) == EXPECTED + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(CONVERSATION, enable_thinking=True) == EXPECTED + "<think>\n"
    ids = tok.encode_chat(CONVERSATION)
    assert ids[0] == 1 and ids.count(1) == 5 and ids.count(2) == 4
    assert tok.decode(ids, skip_special_tokens=False) == EXPECTED


def test_continue_final_message_leaves_the_last_turn_open(tok, tmp_path):
    """As HF's: the conversation is cut right after the final message's text, as written (a trailing space kept)
    or, where the template trimmed it, stripped."""
    start = [{"role": "user", "content": "Add 2 and 3."}]
    trimming = Tokenizer.from_dir(_copy_tokenizer(tmp_path, {"chat_template": "{% for m in messages %}<{{ m.role }}>"
                                                             "{{ m.content | trim }}</{{ m.role }}>{% endfor %}"}))  # fmt: skip
    messages = [*start, {"role": "assistant", "content": " The sum is\n"}]
    assert trimming.apply_chat_template(messages, False, continue_final_message=True) == (
        "<user>Add 2 and 3.</user><assistant>The sum is"
    )
    for content, tail in [("The sum is", "The sum is"), ("The sum is ", "The sum is "), ("\nThe sum\n", "\nThe sum\n")]:
        messages = [*start, {"role": "assistant", "content": content}]
        out = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        assert out == "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n" + tail
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template([*start, {"role": "assistant", "content": "x"}], continue_final_message=True)
    with pytest.raises(ValueError, match="text to continue"):
        tok.apply_chat_template([*start, {"role": "assistant", "content": " "}], False, continue_final_message=True)


def test_text_parts_are_joined_with_newlines(tok):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nfirst\nsecond<|im_end|>\n"


def test_chat_template_reasoning_and_tools(tok):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "weather"}}]
    out = tok.apply_chat_template(messages, tools=tools)
    assert out == (
        "<|im_start|>system\nYou can call these functions. Their signatures are listed below.\n<tools>\n"
        '{"type": "function", "function": {"name": "weather"}}\n</tools>\n'
        "To call one, reply with <tool_call></tool_call> blocks.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the caller's messages are not modified
    assert messages[1]["content"] is None and isinstance(messages[1]["tool_calls"][0]["function"]["arguments"], str)


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "must be a list"),
        ([], "must not be empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], "role"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "no content"),
        ([{"role": "user", "content": None}], "no content"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only 'text'"),
        ([{"role": "user", "content": [{"type": "text"}]}], "text must be a string"),
        ([{"role": "user", "content": ["x"]}], "must be an object"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": "x"}],
            "tool_calls",
        ),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "only allowed first"),
    ],
)
def test_bad_messages_raise_value_error(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


# --- incremental detokenizer -------------------------------------------------------------------------------


def _stream(tok, ids, rng, skip_special_tokens=True):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces, i, max_window = [], 0, 0
    while i < len(ids):
        n = rng.choice((1, 1, 1, 2, 3))
        chunk = ids[i : i + n]
        pieces.append(det.push(chunk[0] if len(chunk) == 1 and rng.random() < 0.5 else chunk))
        max_window = max(max_window, len(det._window))
        i += n
    pieces.append(det.flush())
    return pieces, max_window


def _random_ids(tok, rng) -> list[int]:
    texts = ["😀", "東京", "é", "ok ", "<think>", "\n", "12", "ẞ", "👩‍👧", " the", "🚀x"]
    ids: list[int] = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.4:
            ids += tok.encode(rng.choice(texts))
        elif r < 0.75:
            ids.append(rng.randrange(5, 261))  # single byte tokens, often invalid UTF-8 on their own
        elif r < 0.9:
            ids.append(rng.randrange(tok.vocab_size))
        else:
            ids.append(rng.randrange(5))  # specials and think markers
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_equals_full_decode(tok, skip_special_tokens):
    rng = random.Random(1234 + skip_special_tokens)
    for _ in range(600):
        ids = _random_ids(tok, rng)
        pieces, _ = _stream(tok, ids, rng, skip_special_tokens)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_incremental_detokenizer_never_splits_a_character(tok):
    text = "Tokyo is 東京 😀 and 👩‍👩‍👧 — café!"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 10  # streamed, not held to the end
    assert pieces[-1] == ""


def test_incremental_detokenizer_drops_unknown_and_special_ids(tok):
    ids = [*tok.encode("a😀"), 10_000, 2, *tok.encode("b")]
    assert IncrementalDetokenizer(tok).push(np.int64(ids[0])) == "a"  # numpy scalars are accepted
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = [det.push(i) for i in ids] + [det.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip) == ("a😀b" if skip else "a😀<|im_end|>b")


def test_incremental_detokenizer_window_stays_small(tok):
    rng = random.Random(7)
    text = " ".join(rng.choice(["alpha", "東京", "😀", "beta", "x=1;", "\n"]) for _ in range(600))
    ids = tok.encode(text)
    pieces, max_window = _stream(tok, ids, rng)
    assert "".join(pieces) == text
    assert max_window <= 16
    # a run of lone continuation bytes ends in U+FFFD at every step; the window must not grow with it
    garbage = [_byte_token(tok, 0x80)] * 500 + tok.encode("end")
    pieces, max_window = _stream(tok, garbage, rng)
    assert "".join(pieces) == tok.decode(garbage) == "\ufffd" * 500 + "end"
    assert max_window <= 2 * IncrementalDetokenizer.MAX_HELD + 2


def _byte_token(tok, byte: int) -> int:
    """Id of the single-byte token for `byte`, via the byte-level (GPT-2) byte-to-character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    token = tok.token_id(char)
    assert token is not None and tok.decode([token], skip_special_tokens=False).encode() != b""
    return token


# --- stop strings ------------------------------------------------------------------------------------------


def _run_stops(stops, chunks):
    matcher = StopStringMatcher(stops)
    out, stopped = [], False
    for chunk in chunks:
        emit, stopped = matcher.push(chunk)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped, matcher


def test_stop_string_across_chunks():
    text, stopped, m = _run_stops(["STOP"], ["Hello S", "T", "OP and more"])
    assert (text, stopped, m.matched) == ("Hello ", True, "STOP")
    assert m.push("anything") == ("", True)


def test_an_included_stop_string_ends_the_text():
    m = StopStringMatcher(["STOP", "OP and"], include=True)
    assert m.push("Hello S") == ("Hello ", False)
    assert m.push("TOP and more") == ("STOP", True) and m.matched == "STOP"


def test_stop_string_prefix_is_held_then_released():
    m = StopStringMatcher(["</end>"])
    assert m.push("a </e") == ("a ", False)
    assert m.push("nd") == ("", False)
    assert m.push("x") == ("</endx", False)
    assert m.push("</") == ("", False)
    assert m.flush() == "</"


def test_first_completed_stop_wins_and_empty_stops_ignored():
    assert _run_stops(["world", "o w", ""], ["hell", "o world"])[:2] == ("hell", True)
    # "ba" completes before "abaa" does, whatever the chunking
    assert _run_stops(["abaa", "ba"], ["aabaa"])[:2] == ("aa", True)
    assert _run_stops(["abaa", "ba"], ["a", "a", "b", "a", "a"])[:2] == ("aa", True)
    # of two stops ending at the same place, the longer one is cut
    assert _run_stops(["b", "ab"], ["xab"])[:2] == ("x", True)
    assert _run_stops([""], ["abc"])[:2] == ("abc", False)
    assert _run_stops(["abc"], ["abc"])[:2] == ("", True)


def test_stop_strings_with_token_stream(tok):
    ids = tok.encode("The answer is 42. END trailing 東京")
    det = IncrementalDetokenizer(tok)
    m = StopStringMatcher([" END", "東"])
    out = []
    for i in ids:
        emit, stopped = m.push(det.push(i))
        out.append(emit)
        if stopped:
            break
    assert "".join(out) == "The answer is 42." and stopped and m.matched == " END"


def test_stop_matcher_against_reference():
    rng = random.Random(99)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        full = "".join(rng.choice("abc") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(full) + 1), min(len(full) + 1, rng.randint(0, 5))))
        chunks = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)], strict=True)]
        m = StopStringMatcher(stops)
        emitted, stopped = "", False
        pushed = ""
        for chunk in chunks:
            emit, stopped = m.push(chunk)
            emitted += emit
            pushed += chunk
            if stopped:
                break
            # what is held back is a proper prefix of some stop string
            held = pushed[len(emitted) :]
            assert pushed.startswith(emitted)
            assert held == "" or any(s.startswith(held) and s != held for s in stops)
        if not stopped:
            emitted += m.flush()
        expected, hit = full, False
        for end in range(1, len(full) + 1):  # reference: feed one character at a time
            ending = [s for s in stops if full[:end].endswith(s)]
            if ending:
                expected, hit = full[: end - max(map(len, ending))], True
                break
        assert (emitted, stopped) == (expected, hit), (stops, chunks)
