"""`--deterministic`: a request's greedy tokens, seeded samples and logprobs are bit-identical to the request run
alone, whatever shares its steps. The engine half on the tiny model in bf16 (where the default engine's greedy
tokens do move with the batch), then the server half: `serve --deterministic` in a subprocess, driven by the
official `openai` client.

No tolerance anywhere: the mode's promise is bit-identity, so every comparison is exact. The default engine runs
the same workload as the control, to show that these workloads do reach the batch-dependent rounding the mode
removes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import openai
import pytest
from test_engine import StepSpy, generate, prompt
from test_server import start_serve, stop_serve

from qwen35_jax.sampling import SamplingParams
from qwen35_jax.serving.engine import GenerationParams

SHAPES = dict(max_batch=4, max_prefill_tokens=16, max_model_len=256)
# (prompt, max_tokens): prompts of one and of several 16-token chunks, admitted while others decode.
WORKLOAD = [(3, 12), (40, 6), (17, 9), (25, 6), (9, 10), (33, 8), (16, 7), (50, 5)]


@pytest.fixture(scope="module")
def bf16_tiny():
    from qwen35_jax.api import load_model

    return load_model("tiny", dtype="bfloat16")


@pytest.fixture(scope="module")
def deterministic_engine(engines, bf16_tiny):
    engine = engines.build(bf16_tiny, deterministic=True, **SHAPES)
    yield engine
    engines.release(engine)


@pytest.fixture(scope="module")
def default_engine(engines, bf16_tiny):
    engine = engines.build(bf16_tiny, **SHAPES)
    yield engine
    engines.release(engine)


def greedy(max_tokens: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def seeded(max_tokens: int, seed: int) -> GenerationParams:
    return GenerationParams(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(1.0, seed=seed), logprobs=3)


def fingerprint(result) -> tuple:
    """Everything a request returns that the mode fixes: tokens, their logprobs and the top logprobs, exactly."""
    return tuple(result.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in result.logprobs)


def together_and_alone(engine, requests) -> tuple[list[tuple], list[tuple]]:
    together = [fingerprint(r) for r in generate(engine, requests)]
    alone = [fingerprint(generate(engine, [request])[0]) for request in requests]
    return together, alone


def workload(params) -> list:
    return [(prompt(n, seed=i), params(m)) for i, (n, m) in enumerate(WORKLOAD)]


def test_greedy_requests_return_what_they_return_alone(deterministic_engine, monkeypatch):
    spy = StepSpy(deterministic_engine.runner, monkeypatch)
    together, alone = together_and_alone(deterministic_engine, workload(greedy))
    assert together == alone
    # The workload did share steps (4 rows at once, prompts chunked while others decoded), through one decode
    # program and never a unified one.
    assert {key for key in spy.keys if key[0]} == {(4, 0, 0)} and max(len(p.decode) for p in spy.plans) == 4
    assert any(len(c.token_ids) == 16 and not c.is_last for p in spy.plans for c in p.prefill)


def test_the_default_engine_moves_with_the_batch(default_engine):
    """The control: without the mode, the same workload's greedy tokens or logprobs depend on the batch."""
    together, alone = together_and_alone(default_engine, workload(greedy))
    assert together != alone


def test_eight_copies_of_a_greedy_request_equal_the_lone_one(deterministic_engine):
    request = (prompt(30, seed=50), greedy(12))
    lone = fingerprint(generate(deterministic_engine, [request])[0])
    assert [fingerprint(r) for r in generate(deterministic_engine, [request] * 8)] == [lone] * 8


def test_seeded_samples_equal_the_lone_one_in_copies_and_beside_others(deterministic_engine):
    request = (prompt(20, seed=60), seeded(16, seed=42))
    lone = fingerprint(generate(deterministic_engine, [request])[0])
    assert [fingerprint(r) for r in generate(deterministic_engine, [request] * 6)] == [lone] * 6
    unrelated = (prompt(45, seed=61), greedy(20))
    assert fingerprint(generate(deterministic_engine, [unrelated, request])[1]) == lone
    sampled_workload = [(p, dataclasses.replace(params, sampling=SamplingParams(1.0, seed=i)))
                        for i, (p, params) in enumerate(workload(greedy))]  # fmt: skip
    together, alone = together_and_alone(deterministic_engine, sampled_workload)
    assert together == alone


# ---- the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deterministic_server(compile_cache_dir, tmp_path_factory):
    """`qwen35-jax serve --model tiny --deterministic` in a subprocess, in bf16 (the serve default), where the
    default engine's greedy tokens move with the batch; the later flags override start_serve's."""
    process, url = start_serve(compile_cache_dir, tmp_path_factory.mktemp("serve"), "--deterministic",
                               "--dtype", "bfloat16", "--max-model-len", "256")  # fmt: skip
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        stop_serve(process)


def completion(client, prompt_ids: list[int], max_tokens: int, **sampling) -> tuple:
    response = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=max_tokens, logprobs=2,
                                         extra_body={"ignore_eos": True}, **sampling)  # fmt: skip
    choice = response.choices[0]
    return choice.text, tuple(choice.logprobs.token_logprobs), tuple(map(str, choice.logprobs.top_logprobs))


def concurrently(calls) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_served_greedy_requests_equal_the_lone_one(deterministic_server):
    client, ids = deterministic_server, prompt(30, seed=70)
    lone = completion(client, ids, 16, temperature=0.0)
    assert concurrently([lambda: completion(client, ids, 16, temperature=0.0)] * 8) == [lone] * 8


def test_served_seeded_samples_equal_the_lone_one_also_beside_an_unrelated_request(deterministic_server):
    client, ids = deterministic_server, prompt(22, seed=71)
    lone = completion(client, ids, 16, temperature=1.0, seed=9)
    assert concurrently([lambda: completion(client, ids, 16, temperature=1.0, seed=9)] * 6) == [lone] * 6
    unrelated = prompt(60, seed=72)
    calls = [lambda: completion(client, unrelated, 24, temperature=0.0),
             lambda: completion(client, ids, 16, temperature=1.0, seed=9)]  # fmt: skip
    assert concurrently(calls)[1] == lone
