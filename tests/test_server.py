"""The OpenAI-compatible server, driven by the official `openai` client against real uvicorn on loopback:
completions and chat, streaming and not, logprobs, stop strings and stop ids, token-id prompts, ignore_eos,
usage, metrics, the queue limit, client disconnects, and the `serve` command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest_plugins = ["_server"]

PROMPT_IDS = [17, 230, 45, 301, 99, 12, 400, 77]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def greedy(client, **kwargs):
    fields = {"model": "tiny-test", "temperature": 0.0, "max_tokens": 12} | kwargs
    return client.completions.create(**fields)


# ---- completions ----------------------------------------------------------------------------------------


def test_models_and_health(idle_server):
    models = idle_server.client().models.list()
    assert [m.id for m in models.data] == [idle_server.model_name]
    health = httpx.get(f"{idle_server.root}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_text_prompt_completion_has_usage(idle_server):
    response = greedy(idle_server.client(), prompt="Hello there", max_tokens=8)
    choice = response.choices[0]
    assert response.object == "text_completion" and response.model == idle_server.model_name
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    prompt_tokens = len(idle_server.model.tokenizer.encode("Hello there"))
    assert response.usage.prompt_tokens == prompt_tokens
    assert 1 <= response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == prompt_tokens + response.usage.completion_tokens


def test_token_id_prompt_with_ignore_eos_runs_to_max_tokens(idle_server):
    client = idle_server.client()
    first = greedy(client, prompt=PROMPT_IDS, max_tokens=20, extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens == len(PROMPT_IDS)
    assert first.usage.completion_tokens == 20 and first.choices[0].finish_reason == "length"
    again = greedy(client, prompt=[PROMPT_IDS], max_tokens=20, extra_body={"ignore_eos": True})
    assert again.choices[0].text == first.choices[0].text, "greedy decoding must be deterministic"


def test_seeded_sampling_is_reproducible(idle_server):
    client = idle_server.client()
    fields = dict(prompt=PROMPT_IDS, max_tokens=16, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a, b = greedy(client, **fields), greedy(client, **fields)
    assert a.choices[0].text == b.choices[0].text


def test_seeds_use_all_64_bits(idle_server):
    """1, 2**32 + 1 and -(2**32) + 1 share their low 32 bits; the int64 bounds are accepted."""
    client = idle_server.client()
    texts = [greedy(client, prompt=PROMPT_IDS, max_tokens=16, temperature=1.0, seed=seed,
                    extra_body={"ignore_eos": True}).choices[0].text
             for seed in (1, 2**32 + 1, -(2**32) + 1, 2**63 - 1, -(2**63))]  # fmt: skip
    assert len(set(texts)) == len(texts), texts


def test_completion_logprobs_zero_gives_the_sampled_token(idle_server):
    response = greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=6, logprobs=0, temperature=1.0, seed=3,
                      extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = response.choices[0].logprobs
    assert [list(top.items()) for top in logprobs.top_logprobs] == [
        [(token, chosen)] for token, chosen in zip(logprobs.tokens, logprobs.token_logprobs, strict=True)
    ]


def test_logit_bias_forces_a_token(idle_server):
    """+100 on one token makes it the greedy pick at every step; -100 on it keeps it out."""
    client, token = idle_server.client(), 300
    forced = greedy(client, prompt=PROMPT_IDS, max_tokens=6, logit_bias={str(token): 100},
                    extra_body={"ignore_eos": True})  # fmt: skip
    assert forced.choices[0].text == idle_server.model.tokenizer.decode([token] * 6)
    sampled = greedy(client, prompt=PROMPT_IDS, max_tokens=6, temperature=1.0, seed=2, logit_bias={str(token): 100},
                     extra_body={"ignore_eos": True})  # fmt: skip
    assert sampled.choices[0].text == forced.choices[0].text
    banned = greedy(client, prompt=PROMPT_IDS, max_tokens=24, logit_bias={str(token): -100}, logprobs=0,
                    extra_body={"ignore_eos": True})  # fmt: skip
    assert idle_server.model.tokenizer.decode([token]) not in banned.choices[0].logprobs.tokens


def test_penalties_reach_the_sampler(idle_server):
    """A strong frequency penalty stops the tiny model's repetition (the engine test checks the exact tokens)."""
    client = idle_server.client()
    fields = dict(prompt=PROMPT_IDS, max_tokens=24, logprobs=0, extra_body={"ignore_eos": True})
    plain = greedy(client, **fields).choices[0].logprobs.tokens
    penalized = greedy(client, frequency_penalty=2.0, presence_penalty=1.0, **fields).choices[0].logprobs.tokens
    assert penalized != plain
    assert max(penalized.count(t) for t in penalized) <= max(plain.count(t) for t in plain)


def test_completion_logprobs(idle_server):
    response = greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=6, logprobs=3,
                      extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(response.choices[0].text)


def test_stop_string_cuts_the_text(idle_server):
    client = idle_server.client()
    full = greedy(client, prompt=PROMPT_IDS, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    candidates = [full[i : i + 2] for i in range(2, len(full) - 2)]
    stop = next(s for s in candidates if "\ufffd" not in s and s.strip())
    cut = greedy(client, prompt=PROMPT_IDS, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string(idle_server):
    client = idle_server.client()
    full = greedy(client, prompt=PROMPT_IDS, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    candidates = [full[i : i + 2] for i in range(2, len(full) - 2)]
    stop = next(s for s in candidates if "\ufffd" not in s and s.strip())
    kept = greedy(client, prompt=PROMPT_IDS, max_tokens=24, stop=[stop],
                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(idle_server):
    """A special token forced by logit_bias (<|im_start|>, not an end of sequence) is text only when asked."""
    special = idle_server.model.tokenizer.backend.id_to_token(1)
    fields = {"prompt": PROMPT_IDS, "max_tokens": 3, "logit_bias": {"1": 100}}
    skipped = greedy(idle_server.client(), **fields)
    kept = greedy(idle_server.client(), **fields, extra_body={"skip_special_tokens": False})
    assert skipped.usage.completion_tokens == kept.usage.completion_tokens == 3
    assert special not in skipped.choices[0].text and kept.choices[0].text == special * 3


def test_min_tokens_holds_back_stop_tokens_and_the_end_of_sequence(idle_server):
    """A token forced by logit_bias ends the output at once as a stop token, or as the end of sequence; with
    min_tokens it comes only after that many outputs."""
    client = idle_server.client()
    for end, stop_ids in [(300, [300]), (idle_server.model.tokenizer.eos_token_id, [])]:
        fields = {"prompt": PROMPT_IDS, "max_tokens": 8, "logit_bias": {str(end): 100}}
        at_once = greedy(client, **fields, extra_body={"stop_token_ids": stop_ids})
        held = greedy(client, **fields, extra_body={"stop_token_ids": stop_ids, "min_tokens": 3})
        assert at_once.choices[0].finish_reason == held.choices[0].finish_reason == "stop"
        assert (at_once.usage.completion_tokens, held.usage.completion_tokens) == (1, 4)
    # A stop string is looked for only in the text of the outputs after the first min_tokens.
    word = idle_server.model.tokenizer.decode([300])
    fields = {"prompt": PROMPT_IDS, "max_tokens": 8, "logit_bias": {"300": 100}, "stop": [word]}
    at_once, held = greedy(client, **fields), greedy(client, **fields, extra_body={"min_tokens": 3})
    assert (at_once.choices[0].text, at_once.usage.completion_tokens) == ("", 1)
    assert (held.choices[0].text, held.usage.completion_tokens) == (word * 3, 4)


@pytest.mark.parametrize("extra", [{"min_tokens": 9}, {"min_tokens": 2, "response_format": {"type": "json_object"}}])
def test_min_tokens_that_cannot_hold_is_refused(idle_server, extra):
    with pytest.raises(openai.BadRequestError) as refused:
        greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=8, extra_body=extra)
    assert refused.value.body["param"] == "min_tokens"


def test_stop_token_ids_end_the_output(idle_server):
    every_id = list(range(idle_server.vocab_size))
    response = greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=10,
                      extra_body={"ignore_eos": True, "stop_token_ids": every_id})  # fmt: skip
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == 1


def test_repetition_penalty_follows_the_host_oracle(idle_server):
    """The engine's greedy tokens under vLLM's repetition penalty are `model.generate`'s (the host sampler, over
    the same prompt and output tokens), on completions; chat takes the parameter too."""
    client, model = idle_server.client(), idle_server.model
    # Above 1 bites where the greedy answer comes back to a token it has seen, which PROMPT_IDS' answer never does.
    repeating = [
        210,
        120,
        330,
        48,
        266,
        379,
        230,
        152,
        175,
        490,
        342,
        12,
        230,
        481,
        237,
        49,
        66,
        73,
        257,
        303,
        57,
        7,
        31,
    ]
    for ids, penalty in ((repeating, 1.5), (PROMPT_IDS, 0.6)):
        fields = dict(prompt=ids, max_tokens=16, logprobs=0, extra_body={"ignore_eos": True})
        plain = greedy(client, **fields).choices[0].logprobs.tokens
        answer = greedy(client, **fields | {"extra_body": {"ignore_eos": True, "repetition_penalty": penalty}})
        want = model.generate(ids, 16, ignore_eos=True, repetition_penalty=penalty)
        assert answer.choices[0].text == model.tokenizer.decode(want), penalty
        assert answer.choices[0].logprobs.tokens != plain
    chat = client.chat.completions.create(model=idle_server.model_name, messages=MESSAGES, max_tokens=4,
                                          temperature=0, extra_body={"repetition_penalty": 1.3})  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")


# ---- echo and prompt logprobs ------------------------------------------------------------------------------

# Prompt logprobs against one full prefill of the same fp32 model: the server scores the prompt in 16-token chunks,
# the reference in one, which moves fp32 logprobs by up to ~1e-4 on this model (test_engine.py's LOGPROB_ATOL).
LOGPROB_ATOL = 2e-4
SCORED_IDS = PROMPT_IDS * 3  # 24 tokens: prompt-logprobs steps of 16 and 8


def log_softmax(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_echo_starts_the_text_with_the_prompt(idle_server):
    client, text = idle_server.client(), "Hello there, general"
    plain = greedy(client, prompt=text, max_tokens=5, extra_body={"ignore_eos": True})
    echoed = greedy(client, prompt=text, max_tokens=5, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == text + plain.choices[0].text and echoed.choices[0].logprobs is None
    assert echoed.usage == plain.usage
    ids = greedy(client, prompt=SCORED_IDS, max_tokens=3, echo=True, extra_body={"ignore_eos": True})
    decoded = idle_server.model.tokenizer.decode(SCORED_IDS, skip_special_tokens=False)
    assert ids.choices[0].text.startswith(decoded) and len(ids.choices[0].text) > len(decoded)


def test_echo_logprobs_are_the_prompt_tokens_under_the_model(idle_server):
    """echo with logprobs=3, as lm-evaluation-harness asks: the prompt's tokens lead the logprobs, the first with
    null logprob and null top, each later one with its logprob under the model (against log_softmax of one full
    prefill), its top 3 and itself; the output's tokens follow, as without echo; text_offset indexes the text."""
    client = idle_server.client()
    n = len(SCORED_IDS)
    answer = greedy(client, prompt=SCORED_IDS, max_tokens=4, echo=True, logprobs=3, extra_body={"ignore_eos": True})
    plain = greedy(client, prompt=SCORED_IDS, max_tokens=4, logprobs=3, extra_body={"ignore_eos": True})
    logprobs, text = answer.choices[0].logprobs, answer.choices[0].text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = log_softmax(idle_server.model.logits(SCORED_IDS))
    want = reference[np.arange(n - 1), SCORED_IDS[1:]]
    np.testing.assert_allclose(logprobs.token_logprobs[1:n], want, atol=LOGPROB_ATOL)
    names = [idle_server.server.responses.logprobs.token_text(t) for t in SCORED_IDS]
    assert logprobs.tokens[:n] == names
    for k in range(1, n):
        top = logprobs.top_logprobs[k]
        assert names[k] in top and len(top) <= 4  # the top 3 and the prompt token itself
        best = sorted(top.values(), reverse=True)[:3]
        np.testing.assert_allclose(best, np.sort(reference[k - 1])[::-1][: len(best)], atol=LOGPROB_ATOL)
    assert logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=LOGPROB_ATOL)
    prompt_text = idle_server.model.tokenizer.decode(SCORED_IDS, skip_special_tokens=False)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[n] == len(prompt_text) and text[: len(prompt_text)] == prompt_text


def test_echo_with_max_tokens_zero_is_the_prompt_alone(idle_server):
    answer = greedy(idle_server.client(), prompt="Hello there", max_tokens=0, echo=True, logprobs=1)
    choice, n = answer.choices[0], len(idle_server.model.tokenizer.encode("Hello there"))
    assert choice.text == "Hello there" and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == n and choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert answer.usage.prompt_tokens == n and answer.usage.completion_tokens == 0
    only_text = greedy(idle_server.client(), prompt=SCORED_IDS, max_tokens=0, echo=True)
    assert only_text.choices[0].logprobs is None and only_text.usage.completion_tokens == 0


def test_echo_on_a_batch_of_prompts(idle_server):
    """Each choice echoes its own prompt, text or ids, with its own logprobs, in the order of the batch."""
    client = idle_server.client()
    for prompts in (["Hello there", "Once upon a time", "x"], [SCORED_IDS, [5, 6, 7], [300]]):
        batch = greedy(client, prompt=prompts, max_tokens=2, echo=True, logprobs=0, extra_body={"ignore_eos": True})
        for prompt, choice in zip(prompts, batch.choices, strict=True):
            alone = greedy(client, prompt=[prompt] if isinstance(prompt, list) else prompt, max_tokens=2, echo=True,
                           logprobs=0, extra_body={"ignore_eos": True}).choices[0]  # fmt: skip
            assert choice.text == alone.text and choice.logprobs.tokens == alone.logprobs.tokens
            assert choice.logprobs.token_logprobs[0] is None
            assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-4)
        assert [c.index for c in batch.choices] == [0, 1, 2]


def test_streamed_echo_puts_the_prompt_in_the_first_chunk(idle_server):
    """As vLLM's: the first chunk carries the prompt's text and logprobs with the first token's; the stream adds up
    to the plain answer. With max_tokens=0 the one chunk is the prompt and the finish."""
    client = idle_server.client()
    fields = dict(prompt=SCORED_IDS, max_tokens=5, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    plain = greedy(client, **fields).choices[0]
    chunks = [c.choices[0] for c in greedy(client, stream=True, **fields) if c.choices]
    assert len(chunks[0].logprobs.tokens) == len(SCORED_IDS) + 1 and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == plain.text
    scored = [c.logprobs for c in chunks if c.logprobs is not None]  # the finish's chunk carries no token
    assert [t for lp in scored for t in lp.tokens] == plain.logprobs.tokens
    assert [o for lp in scored for o in lp.text_offset] == plain.logprobs.text_offset
    alone = list(greedy(client, prompt="Hello there", max_tokens=0, echo=True, stream=True))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in alone] == [("Hello there", "length")]


def test_vllm_prompt_logprobs(idle_server):
    """vLLM's prompt_logprobs=2 without echo: the choice's `prompt_logprobs`, null for the first prompt token, then
    by token id the prompt token (its logprob under the model, its rank) and the top 2 (ranks 1 and 2)."""
    answer = greedy(idle_server.client(), prompt=SCORED_IDS, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    reference = log_softmax(idle_server.model.logits(SCORED_IDS))
    assert len(entries) == len(SCORED_IDS) and entries[0] is None
    for k, entry in enumerate(entries[1:], start=1):
        token = SCORED_IDS[k]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(reference[k - 1, token], abs=LOGPROB_ATOL)
        likelier = [np.sum(reference[k - 1] > mine["logprob"] + sign * LOGPROB_ATOL) for sign in (1, -1)]
        assert 1 + likelier[0] <= mine["rank"] <= 1 + likelier[1]
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2] and len(entry) <= 3
    assert "prompt_logprobs" not in greedy(idle_server.client(), prompt=SCORED_IDS, max_tokens=2).choices[0].model_extra


def test_streamed_completion_matches_the_plain_one(idle_server):
    client = idle_server.client()
    plain = greedy(client, prompt=PROMPT_IDS, max_tokens=16, extra_body={"ignore_eos": True})
    chunks = list(greedy(client, prompt=PROMPT_IDS, max_tokens=16, stream=True,
                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_count_each_choices_tokens_so_far(idle_server):
    """vLLM's continuous_usage_stats: every chunk carries its choice's usage so far (the chat role chunk 0 tokens,
    then one more a token, the finish chunk none), the last one the final usage chunk's count; without
    include_usage none does."""
    client = idle_server.client()
    fields = dict(model=idle_server.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                  temperature=0.0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(client.chat.completions.create(
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **fields))  # fmt: skip
    counted = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counted == [*range(7), 6] and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    chunks = list(client.chat.completions.create(stream_options={"continuous_usage_stats": True}, **fields))
    assert all(c.usage is None for c in chunks)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(idle_server):
    """vLLM's truncate_prompt_tokens: the answer is the one to the prompt's last k tokens (echoed as those tokens),
    -1 keeps what the context has room for, and 0 or more than the context is a 400 naming it."""
    client = idle_server.client()
    cut = greedy(client, prompt=PROMPT_IDS, echo=True, extra_body={"truncate_prompt_tokens": 3})
    tail = greedy(client, prompt=PROMPT_IDS[-3:], echo=True)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == tail.choices[0].text
    long_prompt = PROMPT_IDS * 40  # 320 tokens, past the 128-token context
    kept = greedy(client, prompt=long_prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert kept.usage.prompt_tokens == idle_server.max_model_len - 1
    chat = client.chat.completions.create(model=idle_server.model_name, messages=MESSAGES, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    assert chat.usage.prompt_tokens == 5
    for bad in (0, idle_server.max_model_len + 1):
        with pytest.raises(openai.BadRequestError) as caught:
            greedy(client, prompt=PROMPT_IDS, extra_body={"truncate_prompt_tokens": bad})
        assert caught.value.body["param"] == "truncate_prompt_tokens"


def test_raw_stream_ends_with_done(idle_server):
    body = {"model": idle_server.model_name, "prompt": PROMPT_IDS, "max_tokens": 4, "stream": True}
    response = httpx.post(f"{idle_server.base_url}/completions", json=body, headers=idle_server.headers())
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


# ---- several choices: batch prompts and n --------------------------------------------------------------


def test_a_batch_of_prompts_gets_one_choice_each(idle_server):
    """A batch of id lists and one of strings; each choice equals its prompt sent alone (greedy)."""
    client = idle_server.client()
    fields = dict(max_tokens=5, extra_body={"ignore_eos": True})
    for prompts in ([PROMPT_IDS, [5, 6, 7, 8, 9], [300, 2]], ["Hello there", "Once upon a time", "x"]):
        batch = greedy(client, prompt=prompts, **fields)
        alone = [greedy(client, prompt=[p] if isinstance(p, list) else p, **fields) for p in prompts]
        assert [c.index for c in batch.choices] == [0, 1, 2]
        assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
        assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert batch.usage.completion_tokens == 15


def test_n_seeded_samples_are_the_seeds_seed_plus_index(idle_server, monkeypatch):
    """Choice i of a seeded n-sample request is the n=1 request with seed + i: the host-side reference of what
    each choice must be. The prompt's tokens count once in the usage, and it is prefilled once: the other two
    choices take a copy of the first one's caches and feed only the last prompt token."""
    client = idle_server.client()
    fields = dict(prompt=PROMPT_IDS, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    plans, launch = [], idle_server.engine.runner.launch
    monkeypatch.setattr(
        idle_server.engine.runner, "launch", lambda plan, rows: plans.append(plan) or launch(plan, rows)
    )
    many = greedy(client, n=3, seed=41, logprobs=1, **fields)
    monkeypatch.undo()
    assert sum(plan.num_prefill_tokens for plan in plans) == len(PROMPT_IDS) - 1 + 3
    assert sum(len(plan.copies) for plan in plans) == 2
    assert [c.index for c in many.choices] == [0, 1, 2] and len({c.text for c in many.choices}) == 3
    for i, choice in enumerate(many.choices):
        one = greedy(client, n=1, seed=41 + i, logprobs=1, **fields).choices[0]
        assert choice.text == one.text and choice.logprobs.tokens == one.logprobs.tokens
        # fp32 products over 3 rows against 1 differ in their last bits
        assert choice.logprobs.token_logprobs == pytest.approx(one.logprobs.token_logprobs, abs=1e-4)
    assert many.usage.prompt_tokens == len(PROMPT_IDS) and many.usage.completion_tokens == 36


def test_streamed_n_chat_and_batch_completions_end_every_choice(idle_server):
    client = idle_server.client()
    chunks = list(client.chat.completions.create(model=idle_server.model_name, messages=MESSAGES, n=2, max_tokens=6,
                                                 seed=9, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))  # fmt: skip
    plain = client.chat.completions.create(model=idle_server.model_name, messages=MESSAGES, n=2, max_tokens=6, seed=9,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    for choice in plain.choices:
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "length"
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    batch = list(greedy(client, prompt=[PROMPT_IDS, [5, 6, 7]], max_tokens=4, stream=True))
    assert sorted(c.choices[0].index for c in batch if c.choices[0].finish_reason) == [0, 1]


# ---- chat -----------------------------------------------------------------------------------------------


def test_chat_completion(idle_server):
    response = idle_server.client().chat.completions.create(model=idle_server.model_name, messages=MESSAGES,
                                                            max_tokens=8, temperature=0)  # fmt: skip
    message = response.choices[0].message
    assert response.object == "chat.completion" and message.role == "assistant" and isinstance(message.content, str)
    assert response.usage.prompt_tokens == len(idle_server.model.tokenizer.encode_chat(MESSAGES))
    assert 1 <= response.usage.completion_tokens <= 8


def test_chat_default_max_tokens_and_max_completion_tokens(idle_server):
    client = idle_server.client()
    fields = dict(model=idle_server.model_name, messages=MESSAGES, extra_body={"ignore_eos": True})
    default = client.chat.completions.create(**fields)
    assert default.usage.completion_tokens == idle_server.default_chat_max_tokens
    capped = client.chat.completions.create(max_completion_tokens=5, **fields)
    assert capped.usage.completion_tokens == 5 and capped.choices[0].finish_reason == "length"


def test_chat_logprobs(idle_server):
    response = idle_server.client().chat.completions.create(
        model=idle_server.model_name, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.bytes is not None
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    tokenizer = idle_server.model.tokenizer
    special = {tokenizer.id_to_token(i) for i in tokenizer.special_token_ids}  # skipped in the text
    text = bytes(b for e in content if e.token not in special for b in e.bytes).decode("utf-8", errors="replace")
    assert text == response.choices[0].message.content


def test_streamed_chat(idle_server):
    client = idle_server.client()
    fields = dict(model=idle_server.model_name, messages=MESSAGES, max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    plain = client.chat.completions.create(**fields)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **fields))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_developer_role_and_text_parts(idle_server):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]}]  # fmt: skip
    response = idle_server.client().chat.completions.create(model=idle_server.model_name, messages=messages,
                                                            max_tokens=3)  # fmt: skip
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say\nhello."}]
    assert response.usage.prompt_tokens == len(idle_server.model.tokenizer.encode_chat(expected))


# ---- metrics --------------------------------------------------------------------------------------------


def scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.root}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def test_metrics_parse_and_move(idle_server):
    before = scrape(idle_server)
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_ratio", "slot_usage_ratio"):
        assert (f"qwen35_jax_{name}", ()) in before
    runner = idle_server.engine.runner  # built at start, every program
    built, total = before[("qwen35_jax_programs_built", ())], before[("qwen35_jax_programs_total", ())]
    assert built == total == runner.num_compiles + runner.num_row_compiles + runner.num_prompt_compiles > 10
    greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=7, extra_body={"ignore_eos": True})
    after = scrape(idle_server)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("qwen35_jax_prompt_tokens_total") == len(PROMPT_IDS)
    assert moved("qwen35_jax_generation_tokens_total") == 7
    assert moved("qwen35_jax_requests_finished_total", (("finish_reason", "length"),)) == 1
    assert moved("qwen35_jax_time_to_first_token_seconds_count") == 1
    assert moved("qwen35_jax_inter_token_latency_seconds_count") == 6
    assert moved("qwen35_jax_e2e_request_latency_seconds_count") == 1


def test_metrics_show_a_running_request(idle_server):
    stream = greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=100, stream=True,
                    extra_body={"ignore_eos": True})  # fmt: skip
    with stream:
        next(iter(stream))
        during = scrape(idle_server)
    assert during[("qwen35_jax_num_requests_running", ())] == 1
    assert during[("qwen35_jax_kv_cache_usage_ratio", ())] > 0
    assert during[("qwen35_jax_slot_usage_ratio", ())] > 0
    assert during[("qwen35_jax_http_requests_active", ())] == 1
    assert during[vllm_key(idle_server, "vllm:num_requests_running")] == 1
    assert during[vllm_key(idle_server, "vllm:num_requests_waiting")] == 0
    kv_usage = during[vllm_key(idle_server, "vllm:kv_cache_usage_perc")]
    assert 0 < kv_usage <= 1 and kv_usage == during[("qwen35_jax_kv_cache_usage_ratio", ())]


# vLLM's metric families (vllm/v1/metrics/loggers.py) by type, as its dashboards and its tests read them. The text
# parser names a counter's family without `_total`.
VLLM_FAMILIES = {
    "gauge": ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"],
    "counter": ["vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"],
    "histogram": ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                  "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds",
                  "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total"],
}  # fmt: skip


def vllm_key(server, name: str, **labels) -> tuple[str, tuple]:
    """A `scrape` key of a vLLM sample: labelled with the served model's name and engine 0, as vLLM labels them."""
    labels |= {"model_name": server.model_name, "engine": "0"}
    return name, tuple(sorted(labels.items()))


def test_vllm_metric_families_have_vllms_types_and_labels(idle_server):
    greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{idle_server.root}/metrics").text)}
    for kind, names in VLLM_FAMILIES.items():
        for name in names:
            assert name in families and families[name].type == kind, name
            for sample in families[name].samples:
                assert sample.labels["model_name"] == idle_server.model_name and sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    # Token counts in vLLM's 1-2-5 buckets up to the context length (128 here).
    bounds = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    assert families["vllm:num_preemptions"].samples[0].value == 0  # admission reserves every page: no preemption


def scrape_until(server, settled, deadline_s: float = 10.0) -> dict[tuple[str, tuple], float]:
    """Scrapes until `settled(samples)` holds or the deadline passes. The engine thread counts a step's iteration
    tokens just after it has delivered the step's outputs, so a scrape right after the last answer can precede it."""
    end = time.monotonic() + deadline_s
    while not settled(samples := scrape(server)) and time.monotonic() < end:
        time.sleep(0.02)
    return samples


def test_vllm_metrics_count_what_the_answers_report(idle_server):
    """Token counters and per-request histograms move by what the answers' usage and finish reasons say."""
    client, before = idle_server.client(), scrape(idle_server)
    answers = [
        greedy(client, prompt=PROMPT_IDS, max_tokens=5, extra_body={"ignore_eos": True}),  # length
        greedy(client, prompt=PROMPT_IDS[:3], max_tokens=5, logit_bias={"300": 100},
               extra_body={"stop_token_ids": [300]}),  # stop, at the first token
        client.chat.completions.create(model=idle_server.model_name, messages=MESSAGES, max_tokens=6, temperature=0),
    ]  # fmt: skip
    chunks = list(greedy(client, prompt=PROMPT_IDS, max_tokens=4, stream=True,
                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    usages = [a.usage for a in answers] + [chunks[-1].usage]
    finishes = [a.choices[0].finish_reason for a in answers] + ["length"]
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)

    def moved(samples, name, **labels):
        key = vllm_key(idle_server, name, **labels)
        return samples.get(key, 0) - before.get(key, 0)

    after = scrape_until(idle_server, lambda s: moved(s, "vllm:iteration_tokens_total_sum") == prompt + generated)
    assert moved(after, "vllm:prompt_tokens_total") == prompt
    assert moved(after, "vllm:generation_tokens_total") == generated
    for reason in ("stop", "length", "abort", "error"):
        assert moved(after, "vllm:request_success_total", finished_reason=reason) == finishes.count(reason), reason
    assert moved(after, "vllm:request_prompt_tokens_sum") == prompt
    assert moved(after, "vllm:request_generation_tokens_sum") == generated
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds"):  # fmt: skip
        assert moved(after, f"{name}_count") == len(usages), name
    assert moved(after, "vllm:inter_token_latency_seconds_count") == generated - len(usages)
    # One step at a time here: the prefill step, then a decode step per further token.
    assert moved(after, "vllm:iteration_tokens_total_sum") == prompt + generated
    assert moved(after, "vllm:iteration_tokens_total_count") == generated
    # The same observations feed this server's own names.
    own = {name: after[(name, ())] - before.get((name, ()), 0)
           for name in ("qwen35_jax_prompt_tokens_total", "qwen35_jax_generation_tokens_total")}  # fmt: skip
    assert own == {"qwen35_jax_prompt_tokens_total": prompt, "qwen35_jax_generation_tokens_total": generated}


# ---- the queue limit and disconnects -------------------------------------------------------------------


def test_full_queue_answers_429(idle_server):
    client = idle_server.client()
    max_batch = idle_server.engine_config.max_batch
    idle_server.server.max_queue = 0
    streams = []
    try:
        for _ in range(max_batch):
            streams.append(greedy(client, prompt=PROMPT_IDS, max_tokens=100, stream=True,
                                  extra_body={"ignore_eos": True}))  # fmt: skip
            next(iter(streams[-1]))
        with pytest.raises(openai.RateLimitError) as caught:
            greedy(client, prompt=PROMPT_IDS, max_tokens=2)
        assert caught.value.status_code == 429 and "--max-queue" in caught.value.message
    finally:
        idle_server.server.max_queue = idle_server.max_queue
        for stream in streams:
            stream.close()
    assert greedy(client, prompt=PROMPT_IDS, max_tokens=2).usage.completion_tokens >= 1


def test_fifty_clients_that_disconnect_leave_every_slot_and_page_free(idle_server):
    async def one(client, i: int) -> None:
        stream = await client.completions.create(
            model=idle_server.model_name, prompt=PROMPT_IDS + [i % 200], max_tokens=100, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        received = 0
        async for _ in stream:
            received += 1
            if received > i % 4:  # leave after 1..4 chunks
                break
        await stream.close()

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=idle_server.base_url, api_key=idle_server.api_key, max_retries=0,
                                    timeout=120)  # fmt: skip
        async with client:
            await asyncio.gather(*(one(client, i) for i in range(50)))

    def finished(reason: str) -> float:
        return scrape(idle_server).get(("qwen35_jax_requests_finished_total", (("finish_reason", reason),)), 0)

    aborted_before, length_before = finished("abort"), finished("length")
    asyncio.run(main())
    state = idle_server.wait_idle(deadline_s=120)
    assert not any(state.values()), f"pools not free after the disconnects: {state}"
    aborted, ran_out = finished("abort") - aborted_before, finished("length") - length_before
    # Every client leaves after at most 4 of its 100 tokens; only a client stalled for ~100 engine steps
    # could see its request finish first.
    assert aborted + ran_out == 50 and aborted >= 40, (aborted, ran_out)
    assert greedy(idle_server.client(), prompt=PROMPT_IDS, max_tokens=2).usage.completion_tokens >= 1


def test_a_non_streaming_client_that_leaves_aborts_its_request(idle_server):
    before = scrape(idle_server).get(("qwen35_jax_requests_finished_total", (("finish_reason", "abort"),)), 0)
    body = {"model": idle_server.model_name, "prompt": PROMPT_IDS[:2], "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{idle_server.base_url}/completions", json=body, headers=idle_server.headers(), timeout=0.05)
    state = idle_server.wait_idle()
    assert not any(state.values()), state
    after = scrape(idle_server)[("qwen35_jax_requests_finished_total", (("finish_reason", "abort"),))]
    assert after - before == 1


# ---- the command line -----------------------------------------------------------------------------------


@pytest.fixture()
def no_weight_loads(monkeypatch):
    import qwen35_jax.api

    def fail(*args, **kwargs):
        raise AssertionError("weights were loaded before the flags were checked")

    monkeypatch.setattr(qwen35_jax.api, "load_model", fail)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-batch", "0"], "--max-batch"),
        (["--max-prefill-tokens", "4"], "--max-prefill-tokens"),
        (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction"),
        (["--decode-overlap", "green"], "--decode-overlap"),
        (["--overlap-step-bound", "0.5"], "--overlap-step-bound"),
        (["--deterministic", "--decode-overlap", "stream"], "--deterministic cannot be combined with --decode-overlap"),
        (["--scheduler-policy", "fast"], "--scheduler-policy"),
        (["--kernels", "pallas"], "--kernels"),
        (["--num-pages", "1"], "--num-pages"),
        (["--mamba-ssm-cache-dtype", "float16"], "--mamba-ssm-cache-dtype"),
        (["--max-model-len", "100000"], "--max-model-len"),
        (["--port", "70000"], "--port"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--api-key", ""], "--api-key"),
        (["--allowed-origins", "*"], "--allowed-origins"),  # not a JSON list
        (["--allowed-headers", "[1]"], "--allowed-headers"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser"),
        (["--tool-call-parser", "hermes"], "--tool-call-parser"),
        (["--model", "/no/such/folder"], "--model"),
    ],
)
def test_serve_flags_are_checked_before_any_weight_loads(flags, named, no_weight_loads, capsys):
    from qwen35_jax.cli import main

    assert main(["serve", "--model", "tiny", *flags]) == 2
    assert named in capsys.readouterr().err


def test_serve_refuses_a_taken_port(no_weight_loads, capsys):
    from qwen35_jax.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
    assert "--port" in capsys.readouterr().err


def test_serve_command_starts_announces_and_serves(live_server, tmp_path):
    """The real `qwen35-jax serve` in a subprocess, with the session's compilation cache (so it is quick)."""
    command = [sys.executable, "-m", "qwen35_jax.cli", "serve", "--model", "tiny", "--dtype", "float32",
               "--port", "0", "--max-batch", "4", "--max-prefill-tokens", "16", "--max-model-len", "128",
               "--compile-cache", live_server.compile_cache, "--served-model-name", "cli-tiny"]  # fmt: skip
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True,
                                   env=os.environ)  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith("qwen35-jax serving cli-tiny on http://127.0.0.1:"), (line, stderr.read_text())
        url = line.split(" on ")[1].split()[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.completions.create(model="cli-tiny", prompt=PROMPT_IDS, max_tokens=3)
        assert response.usage.completion_tokens >= 1
    finally:
        stop_serve(process)
    progress = stderr.read_text()
    assert "loading weights" in progress and "compiling step programs" in progress
    assert "froze the start-up heap" in progress  # out of the garbage collector's scans (factory.freeze_startup_heap)
    assert process.stdout.read() == "", "start-up must print exactly one line to stdout"


def start_serve(compile_cache: str, tmp_path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`qwen35-jax serve` on the tiny model in a subprocess (the live server's programs, so its cache is warm);
    returns the process and its root URL."""
    command = [sys.executable, "-m", "qwen35_jax.cli", "serve", "--model", "tiny", "--dtype", "float32",
               "--port", "0", "--max-batch", "4", "--max-prefill-tokens", "16", "--max-model-len", "128",
               "--compile-cache", compile_cache, *flags]  # fmt: skip
    stderr = (tmp_path / "stderr.txt").open("w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=os.environ)
    line = process.stdout.readline()
    assert " on http://" in line, (line, (tmp_path / "stderr.txt").read_text())
    return process, line.split(" on ")[1].split()[0]


def stop_serve(process: subprocess.Popen) -> None:
    """Ctrl+C, as a user stops `serve`; killed if it has not exited within 30 s."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    finally:
        process.kill()


async def stream_to_the_end(client: httpx.AsyncClient, url: str, first: asyncio.Event, max_tokens: int) -> dict:
    """One streamed completion; the finish reason of its last chunk and whether `[DONE]` came."""
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    seen = {"finish_reason": None, "done": False, "chunks": 0}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                seen["done"] = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            seen["chunks"] += 1
            seen["finish_reason"] = chunk["choices"][0]["finish_reason"] or seen["finish_reason"]
            first.set()
    return seen


@pytest.mark.parametrize("shutdown_timeout, finish_reasons", [("0", {"abort"}), ("60", {"length"})],
                         ids=["abort-at-once", "drain"])  # fmt: skip
def test_sigterm_ends_every_stream_with_a_finish_reason(live_server, tmp_path, shutdown_timeout, finish_reasons):
    """SIGTERM with 8 streams in flight (4 running, 4 queued): with --shutdown-timeout 0 each ends at once with
    finish_reason "abort", with 60 each runs to its length; every one gets `[DONE]` and the process exits."""
    process, url = start_serve(live_server.compile_cache, tmp_path, "--shutdown-timeout", shutdown_timeout)

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            first = asyncio.Event()  # set by whichever stream the engine admitted first
            streams = [asyncio.create_task(stream_to_the_end(client, url, first, 100)) for _ in range(8)]
            await asyncio.wait_for(first.wait(), 60)
            process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams)

    try:
        results = asyncio.run(run())
        # A hang guard, not a timing check: the drain case ends when its streams do. uvicorn re-raises the
        # SIGTERM it handled once it has shut down, so the process ends by that signal.
        assert process.wait(timeout=float(shutdown_timeout) + 60) in (0, -signal.SIGTERM)
    finally:
        process.kill()
    assert all(r["done"] for r in results), results
    assert {r["finish_reason"] for r in results} == finish_reasons, results
    # A chunk per token, the last carrying the finish reason: the drained streams got all 100 tokens.
    assert all((r["chunks"] >= 100) == (finish_reasons == {"length"}) for r in results), results


def test_browsers_may_call_the_api_from_any_origin(live_server):
    """CORS as vLLM's defaults set it: a preflight is answered without the API key, and answers carry the
    allow-origin header."""
    origin = {"Origin": "https://ui.example"}
    preflight = httpx.options(f"{live_server.root}/v1/chat/completions",
                              headers=origin | {"Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization,content-type"})  # fmt: skip
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] in ("*", "https://ui.example")
    assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(f"{live_server.root}/v1/models", headers=origin | live_server.headers())
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


class _Collected:
    def __init__(self):
        self.messages = []

    async def __call__(self, message):
        self.messages.append(message)


def _gate_call(app) -> list[dict]:
    """Runs the gate in front of `app` on one request; the messages it sent."""
    from qwen35_jax.serving.metrics import ServingMetrics
    from qwen35_jax.serving.middleware import Gate
    from qwen35_jax.serving.server_config import ServerConfig

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    sent = _Collected()
    gate = Gate(app, ServerConfig("m", 64, 100), ServingMetrics("m", 64))
    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"content-length", b"2")]}
    asyncio.run(gate(scope, receive, sent))
    return sent.messages


def test_an_unexpected_error_is_a_500_in_the_error_shape_and_not_raised_on():
    """Raised on, it reached Starlette's last-resort handler, which answers and re-raises, and the server then
    dropped the connection: the client's next request on it failed too."""

    async def broken(scope, receive, send):
        raise TypeError("a bug")

    start, body = _gate_call(broken)
    assert start["status"] == 500
    assert json.loads(body["body"])["error"] == {"message": "internal error: TypeError",
                                                 "type": "internal_server_error", "param": None,
                                                 "code": "internal_error"}  # fmt: skip


def test_an_error_after_the_answer_started_sends_nothing_more():
    async def broken_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise TypeError("a bug mid-stream")

    (start,) = _gate_call(broken_stream)
    assert start == {"type": "http.response.start", "status": 200, "headers": []}


def test_the_app_loads_anyios_backend_before_it_serves(live_server):
    """Starlette's streamed responses import anyio's asyncio backend at their first use. The app's startup (run by
    uvicorn before the socket accepts) loads it, so that the import does not stall the event loop inside a fresh
    server's first requests. A fresh interpreter shows the import is not done by importing the server, and is
    done by its startup; the live server shows the app runs that startup."""
    from qwen35_jax.serving.server import _startup

    assert live_server.uvicorn.config.app.router.lifespan_context is _startup
    code = (
        "import asyncio, sys\n"
        "from qwen35_jax.serving.server import _startup\n"
        "backend = 'anyio._backends._asyncio'\n"
        "assert backend not in sys.modules, 'loaded by the import alone'\n"
        "async def start():\n"
        "    async with _startup(None):\n"
        "        assert backend in sys.modules\n"
        "asyncio.run(start())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
