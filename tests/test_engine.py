"""The serving engine on the CPU with tiny fp32 models: greedy against the HF goldens, what batching,
chunking and sampling must not change, finish reasons, cancellation, step errors, rejected requests and
the bound on compiled programs; then unit tests of the device sampler.

Engines are expensive here (each step program takes seconds to compile on the CPU), so the file builds
one fully compiled engine (`engine`: 15 step programs, 2 prompt-logprobs programs), one with a 16-token prefill budget whose 7 programs load
from the session's compile cache (`chunked_engine`), and small lazily compiled engines for the golden
checkpoints. Every test leaves them idle; conftest's autouse fixture checks that (no KV page or GDN slot
held, no live generation, nothing queued or in flight, no program outside the bucket set).

Tolerances: two fp32 runs that differ only in summation order (another batch bucket, other chunk sizes)
move logprobs by up to ~2e-5 on these models (mostly ~1e-6), so logprobs are compared to 1e-4, and a
greedy argmax may only flip where the top two logprobs are within 1e-4 of each other (`assert_same_greedy`;
no such flip happens in this file today). Runs whose inputs and batch are identical must agree bit for
bit. Our fp32 logits match HF's golden fp32 logits to < 1e-5.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.api import load_model
from qwen35_jax.sampling import SamplingParams, filtered_probs
from qwen35_jax.serving import device_sampling
from qwen35_jax.serving.device_sampling import SamplingRows
from qwen35_jax.serving.engine import GenerationParams, RequestOutput, SamplingRow, TokenLogprob
from qwen35_jax.serving.plan import DecodeRow, PrefillChunk, StepPlan
from qwen35_jax.serving.runner import Buckets, StepHandle
from qwen35_jax.serving.scheduler import RequestRejected

GOLDEN_DIR = Path(__file__).parent / "fixtures" / "golden"
GOLDEN_CASES = sorted(p.name for p in GOLDEN_DIR.iterdir() if (p / "golden.npz").is_file())

TIE_GAP = 1e-4  # a greedy argmax may flip between equivalent fp32 runs only below this top-2 logprob gap
LOGPROB_ATOL = 2e-4  # logprobs of equivalent fp32 runs (observed up to 1.1e-4: 16- against 64-token GDN chunks)
HF_LOGPROB_ATOL = 1e-4  # engine logprobs against HF's fp32 goldens (observed < 1e-5)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch: compile or cache load


# ---- engines ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(engines, tiny_model):
    """Every bucket compiled at build: decode B in {1, 2, 4}, chunk T in {16, 32, 64}, and every B at T = 64 (the
    unified programs start at UNIFIED_MIN_CHUNK); and the prompt-logprobs steps of chunk T in {16, 32}."""
    engine = engines.build(tiny_model, max_batch=4, max_prefill_tokens=64, max_model_len=512, prompt_logprobs_chunk=32)
    yield engine
    engines.release(engine)


@pytest.fixture(scope="module")
def chunked_engine(engines, tiny_model, engine):
    """The same model and pools with a 16-token prefill budget. Its decode-only and prefill-only programs have
    the shapes of `engine`'s (`engine` is built first), so they load from the session's compile cache."""
    chunked = engines.build(tiny_model, max_batch=4, max_prefill_tokens=16, max_model_len=512)
    yield chunked
    engines.release(chunked)


@dataclasses.dataclass
class GoldenCase:
    model: object
    engine: object
    prompt: list[int]  # decode_prompt [40]
    forced: list[int]  # decode_tokens [8]: random tokens fed teacher-forced after the prompt
    logits: np.ndarray  # [9, V] HF fp32: row j = logits after prompt + forced[:j]


@pytest.fixture(scope="module")
def golden_cases(engines):
    """GoldenCase by name, loaded on first use; its engine compiles only the programs a test needs."""
    built: dict[str, GoldenCase] = {}

    def get(name: str) -> GoldenCase:
        if name not in built:
            folder = GOLDEN_DIR / name
            data = np.load(folder / "golden.npz")
            model = load_model(folder, dtype="float32")
            engine = engines.build(model, compile_now=False, max_batch=2, max_prefill_tokens=64, max_model_len=128)
            built[name] = GoldenCase(model, engine, data["decode_prompt"].tolist(), data["decode_tokens"].tolist(),
                                     data["decode_logits_fp32"])  # fmt: skip
        return built[name]

    yield get
    for case in built.values():
        engines.release(case.engine)


# ---- requests and results -----------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str
    error: str | None


class Collector:
    """The on_output callback of a test's requests: keeps every delivery per request, in order."""

    def __init__(self):
        self.outputs: dict[str, list[RequestOutput]] = collections.defaultdict(list)
        self.finished = threading.Condition()

    def __call__(self, output: RequestOutput) -> None:
        with self.finished:
            self.outputs[output.request_id].append(output)
            self.finished.notify_all()

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in list(self.outputs[request_id]) for t in o.token_ids]

    def is_finished(self, request_id: str) -> bool:
        return any(o.finish_reason is not None for o in list(self.outputs[request_id]))

    def wait(self, predicate, timeout: float = 300.0) -> None:
        """For the threaded loop; the timeout only keeps a broken engine from hanging the test run."""
        with self.finished:
            assert self.finished.wait_for(predicate, timeout), "the engine thread stopped delivering"

    def result(self, request_id: str, num_prompt_tokens: int | None = None) -> Result:
        outputs = self.outputs[request_id]
        finishes = [i for i, o in enumerate(outputs) if o.finish_reason is not None]
        assert finishes == [len(outputs) - 1], f"{request_id} must finish exactly once, in its last delivery"
        last = outputs[-1]
        token_ids = self.tokens(request_id)
        assert last.num_output_tokens == len(token_ids)
        if num_prompt_tokens is not None:
            assert last.num_prompt_tokens == num_prompt_tokens
        logprobs = [lp for o in outputs if o.logprobs for lp in o.logprobs]
        return Result(token_ids, "".join(o.text for o in outputs), logprobs, last.finish_reason, last.error)


def prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, length).tolist()


def greedy(max_tokens: int, **fields) -> GenerationParams:
    """Greedy, to the length limit, with the top-2 logprobs that `assert_same_greedy` needs."""
    return GenerationParams(**({"max_tokens": max_tokens, "ignore_eos": True, "logprobs": 2} | fields))


def sampled(max_tokens: int, seed: int) -> GenerationParams:
    """Sampled at temperature 0.8 with a seed, to the length limit."""
    return GenerationParams(max_tokens, ignore_eos=True, sampling=SamplingParams(0.8, seed=seed), logprobs=2)


def generate(engine, requests: list[tuple[list[int], GenerationParams]]) -> list[Result]:
    """Submit all requests at once, run the engine inline until idle, return the results in order."""
    collector = Collector()
    ids = [engine.submit(p, params, collector) for p, params in requests]
    engine.run_until_done()
    return [collector.result(rid, len(p)) for rid, (p, _) in zip(ids, requests, strict=True)]


def assert_same_greedy(result: Result, reference: Result) -> None:
    """Same greedy tokens, logprobs within LOGPROB_ATOL. An equivalent fp32 computation may flip the argmax
    only where the reference's top two logprobs are within TIE_GAP; the sequences diverge from there, so
    the comparison stops. A flip anywhere else fails."""
    assert len(result.token_ids) == len(reference.token_ids)
    for i, (got, want) in enumerate(zip(result.logprobs, reference.logprobs, strict=True)):
        if got.token_id != want.token_id:
            gap = want.top[0][1] - want.top[1][1]
            assert gap < TIE_GAP, f"token {i}: {got.token_id} != {want.token_id}, top-2 logprob gap {gap:.2e}"
            return
        assert abs(got.logprob - want.logprob) <= LOGPROB_ATOL, f"token {i}: {got.logprob} vs {want.logprob}"


class StepSpy:
    """Wraps `runner.launch` to record each step's bucket key and plan."""

    def __init__(self, runner, monkeypatch):
        self.keys: list[tuple[int, int, int]] = []
        self.plans = []
        launch = runner.launch

        def spy(plan, sampling):
            self.keys.append(runner.buckets.key_for(plan))
            self.plans.append(plan)
            return launch(plan, sampling)

        monkeypatch.setattr(runner, "launch", spy)

    def chunk_lengths(self) -> list[int]:
        return [len(c.token_ids) for plan in self.plans for c in plan.prefill]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# ---- greedy against HF --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_next_token_matches_hf_greedy(golden_cases, case):
    """HF's greedy next token for 9 contexts of each golden checkpoint: the decode prompt followed by 0..8
    teacher-forced tokens; HF's logits after each are stored, so HF's greedy choice is their argmax."""
    golden = golden_cases(case)
    contexts = [golden.prompt + golden.forced[:j] for j in range(len(golden.logits))]
    results = generate(golden.engine, [(c, greedy(1, logprobs=1)) for c in contexts])
    hf_logprobs = log_softmax(golden.logits)
    for j, result in enumerate(results):
        top2 = np.sort(golden.logits[j])[-2:]
        # The smallest top-2 gap in these fixtures is ~1e-2, far above the < 1e-5 between our logits and
        # HF's: the argmax is decided, not a tie.
        assert top2[1] - top2[0] > 1e-3
        assert result.token_ids == [int(np.argmax(golden.logits[j]))], f"context {j}"
        assert result.logprobs[0].logprob == pytest.approx(hf_logprobs[j, result.token_ids[0]], abs=HF_LOGPROB_ATOL)


def test_a_step_brings_the_tokens_logprob_home_only_when_a_row_wants_it(golden_cases, monkeypatch):
    """logprobs=0 asks for the token's own logprob and no top ones: it comes back, equal to HF's, beside a request
    that asked for none in the same steps. Steps in which no row asks leave the logprob on the device (the handle's
    logprob output is None: no copy to the host is started), and their tokens are the same."""
    golden = golden_cases("composite_untied_gqa2")
    handles = []
    launch = golden.engine.runner.launch

    def spy(plan, sampling):
        handles.append(launch(plan, sampling))
        return handles[-1]

    monkeypatch.setattr(golden.engine.runner, "launch", spy)
    own, plain = generate(
        golden.engine, [(golden.prompt, greedy(1, logprobs=0)), (golden.prompt, greedy(1, logprobs=None))]
    )
    assert own.token_ids == plain.token_ids == [int(np.argmax(golden.logits[0]))]
    assert own.logprobs[0].top == [] and not plain.logprobs
    want = log_softmax(golden.logits)[0, own.token_ids[0]]
    assert own.logprobs[0].logprob == pytest.approx(want, abs=HF_LOGPROB_ATOL)
    assert any(h.outputs[1] is not None for h in handles)  # the steps of logprobs=0's rows
    handles.clear()
    (alone,) = generate(golden.engine, [(golden.prompt, greedy(3, logprobs=None))])
    assert alone.token_ids[0] == plain.token_ids[0] and not alone.logprobs
    assert handles and all(h.outputs[1] is None for h in handles)


def test_greedy_generation_matches_hf_and_model(golden_cases):
    """Multi-token greedy. HF's greedy continuation itself is not stored (the golden's decode tokens are
    random, teacher-forced), so: the first token is HF's argmax; each later token must be the argmax of
    `model.logits(prompt + generated[:i])`, one full prefill whose logits the golden tests check against
    HF; and the whole sequence must equal `model.generate` (one full prefill, then single-row decode).
    An untied checkpoint: random tied models mostly repeat their input token, a weak check."""
    golden = golden_cases("composite_untied_gqa2")
    result = generate(golden.engine, [(golden.prompt, greedy(8))])[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 8
    assert result.token_ids[0] == int(np.argmax(golden.logits[0]))
    for i, token in enumerate(result.token_ids):
        logits = golden.model.logits(golden.prompt + result.token_ids[:i])[-1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, f"token {i} is a near-tie; pick another prompt"
        assert token == int(np.argmax(logits)), f"token {i}"
        assert result.logprobs[i].logprob == pytest.approx(log_softmax(logits)[token], abs=LOGPROB_ATOL)
    assert result.token_ids == golden.model.generate(golden.prompt, 8, ignore_eos=True)


def test_penalties_follow_the_host_oracle(golden_cases):
    """presence/frequency penalties, greedy: the engine (penalties from device-side output-token counts) against
    `model.generate` (the host sampler, counting the same tokens), on the same model."""
    golden = golden_cases("composite_untied_gqa2")
    penalties = dict(presence_penalty=0.5, frequency_penalty=2.0)
    params = GenerationParams(12, ignore_eos=True, sampling=SamplingParams(**penalties))
    result = generate(golden.engine, [(golden.prompt, params)])[0]
    assert result.token_ids == golden.model.generate(golden.prompt, 12, ignore_eos=True, **penalties)
    assert result.token_ids != generate(golden.engine, [(golden.prompt, greedy(12))])[0].token_ids  # they bite


def test_the_sampler_counts_output_tokens_per_slot():
    """The counts the penalties read: a first output token (index 0) starts its slot from zero, later ones add,
    and a chunk that samples nothing (index -1) leaves its slot alone."""
    from qwen35_jax.serving.runner import sampler_step

    vocab, slots = 16, np.array([0, 1, 2])
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 5] = 1.0  # every greedy pick is 5 unless penalised
    counts = np.zeros((4, vocab), np.int32)
    counts[0, 5] = counts[1, 5] = counts[2, 5] = 3  # stale or earlier counts
    rows = sampling_rows(3, frequency_penalty=1.0, output_index=[0, 4, -1])
    no_prompt = np.zeros((4, vocab), bool)
    _, new_counts, tokens, _ = jax.jit(sampler_step)(logits, rows, np.zeros(4, np.int32), counts, no_prompt, slots,
                                                     np.full(3, 5))  # fmt: skip
    new_counts = np.asarray(new_counts)
    # row 0 restarts (its stale 3 is gone) and picks 5; row 1 has 5 three times: 1 - 3 < 0, so token 0 wins
    assert np.asarray(tokens)[:2].tolist() == [5, 0]
    assert new_counts[0].tolist() == np.eye(vocab, dtype=int)[5].tolist()
    assert new_counts[1, 5] == 3 and new_counts[1, 0] == 1 and new_counts[2].tolist() == counts[2].tolist()


def test_repetition_penalty_follows_the_host_oracle(golden_cases):
    """The repetition penalty (over the prompt's and the output's tokens), alone and before presence and frequency,
    greedy: the engine (the prompt's tokens marked on the device) against `model.generate` (the host sampler)."""
    golden = golden_cases("composite_untied_gqa2")
    plain = generate(golden.engine, [(golden.prompt, greedy(12))])[0].token_ids
    for penalties in (dict(repetition_penalty=1.3), dict(repetition_penalty=0.7, presence_penalty=0.5,
                                                         frequency_penalty=1.0)):  # fmt: skip
        params = GenerationParams(12, ignore_eos=True, sampling=SamplingParams(**penalties))
        result = generate(golden.engine, [(golden.prompt, params)])[0]
        assert result.token_ids == golden.model.generate(golden.prompt, 12, ignore_eos=True, **penalties), penalties
        assert result.token_ids != plain  # it bites


def test_repetition_penalty_over_chunked_prompts_in_reused_slots(chunked_engine, tiny_model):
    """Prompts of 16-token chunks, two batches one after the other on the same slots: each penalised request
    marks its whole prompt from a clean row, and an unpenalised request beside them keeps its greedy tokens."""
    for batch in range(2):
        prompts = [prompt(50 + 7 * batch, seed=700 + batch), prompt(23, seed=710 + batch), prompt(30, seed=720)]
        penalties = [(0.3, 3.0), (3.0, 0.3)][batch]  # below 1 favours seen tokens, above 1 disfavours them
        requests = [(p, GenerationParams(8, ignore_eos=True, sampling=SamplingParams(repetition_penalty=r)))
                    for p, r in zip(prompts, penalties, strict=False)] + [(prompts[2], greedy(8))]  # fmt: skip
        results = generate(chunked_engine, requests)
        for p, r, result in zip(prompts, penalties, results, strict=False):
            assert result.token_ids == tiny_model.generate(p, 8, ignore_eos=True, repetition_penalty=r), (batch, r)
            assert result.token_ids != tiny_model.generate(p, 8, ignore_eos=True), (batch, r)
        assert_same_greedy(results[2], generate(chunked_engine, [requests[2]])[0])


def test_penalties_match_the_host_order_of_operations():
    """repetition (over prompt and output tokens), then presence and frequency, then logit_bias: the device's
    greedy pick against the argmax of the host's `biased`, on random logits, prompts and outputs."""
    from qwen35_jax.sampling import biased

    vocab, rng = 300, np.random.default_rng(9)
    logits = random_logits(6, vocab, seed=9)
    params = [SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f, logit_bias=b)
              for r, p, f, b in [(1.5, 0, 0, ()), (0.5, 0, 0, ()), (2.0, 0.5, 1.0, ()), (2.0, 0, 0, ((3, 5.0),)),
                                 (1.0, 2.0, 1.0, ()), (3.0, -1.0, 0.5, ((7, -2.0),))]]  # fmt: skip
    # Each prompt holds the row's best three tokens, or (below 1, which favours them) its fifth; each output its best,
    # except below 1.
    order = np.argsort(-logits, axis=-1)
    prompts = [np.concatenate([order[i, :3] if s.repetition_penalty > 1 else order[i, 4:5], rng.integers(0, vocab, 30)])
               for i, s in enumerate(params)]  # fmt: skip
    outputs = [np.concatenate([order[i, : int(s.repetition_penalty >= 1)], rng.integers(0, vocab, 11)])
               for i, s in enumerate(params)]  # fmt: skip
    rows = SamplingRows.from_rows([SamplingRow(0.0, 0, 1.0, 0.0, 0, 12, 0, s.logit_bias, s.presence_penalty,
                                               s.frequency_penalty, s.repetition_penalty) for s in params], 6,
                                  all_allowed(6))  # fmt: skip
    counts = np.stack([np.bincount(o, minlength=vocab) for o in outputs]).astype(np.int32)
    in_prompt = np.zeros((6, vocab), bool)
    for i, p in enumerate(prompts):
        in_prompt[i, p] = True
    tokens, _ = jax.jit(device_sampling.resample)(logits, rows, np.argmax(logits, -1).astype(np.int32), counts,
                                                  in_prompt)  # fmt: skip
    want = [int(np.argmax(biased(logits[i], s, outputs[i], prompts[i]))) for i, s in enumerate(params)]
    assert np.asarray(tokens).tolist() == want
    assert (np.asarray(want) != order[:, 0]).all()  # every row's penalties moved its pick


# ---- prompt logprobs ----------------------------------------------------------------------------------


def prompt_logprobs_of(collector: Collector, request_id: str) -> list[TokenLogprob]:
    """The prompt logprobs a request delivered: all of them, on its first output, and on no other."""
    outputs = collector.outputs[request_id]
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    return outputs[0].prompt_logprobs


def test_prompt_logprobs_match_one_full_prefill(engine, tiny_model, monkeypatch):
    """A 70-token prompt scored in prompt-logprobs steps of 32, 32 and 6 tokens, while another request decodes:
    each prompt token's logprob, rank and top 5 against log_softmax of `model.logits` (one full prefill) to
    LOGPROB_ATOL (the same fp32 model, other chunking); its output tokens are an unscored request's, and the
    decoder's tokens are its own alone."""
    p, decoder = prompt(70, seed=600), (prompt(6, seed=601), greedy(16))
    spy = StepSpy(engine.runner, monkeypatch)
    collector = Collector()
    decoding = engine.submit(*decoder, collector)
    engine.step()
    scored = engine.submit(p, greedy(4, prompt_logprobs=5), collector)
    engine.run_until_done()
    entries = prompt_logprobs_of(collector, scored)
    reference = log_softmax(tiny_model.logits(p))
    assert [e.token_id for e in entries] == p[1:]
    for j, entry in enumerate(entries):
        want = reference[j, p[j + 1]]
        assert abs(entry.logprob - want) <= LOGPROB_ATOL, j
        # Ranks and the top list may differ where the reference's logprobs lie within the tolerance of each other.
        likelier = [np.sum(reference[j] > want + sign * LOGPROB_ATOL) for sign in (1, -1)]
        assert 1 + likelier[0] <= entry.rank <= 1 + likelier[1], j
        top_ids, top_lps = zip(*entry.top, strict=True)
        np.testing.assert_allclose(top_lps, np.sort(reference[j])[::-1][:5], atol=LOGPROB_ATOL)
        np.testing.assert_allclose(top_lps, reference[j, list(top_ids)], atol=LOGPROB_ATOL)
    scored_plans = [plan for plan in spy.plans if plan.prompt_logprobs]
    assert [len(plan.prefill[0].token_ids) for plan in scored_plans] == [32, 32, 6]
    assert all(not plan.decode for plan in scored_plans) and any(plan.decode for plan in spy.plans)
    assert_same_greedy(collector.result(scored, 70), generate(engine, [(p, greedy(4))])[0])
    assert_same_greedy(collector.result(decoding), generate(engine, [decoder])[0])


def test_a_prompt_only_request_delivers_its_prompt_logprobs_and_no_token(engine):
    """max_tokens 0: one output, the finish ("length"), carrying the prompt's logprobs; a one-token prompt has
    none to carry (its first token is never scored)."""
    collector = Collector()
    long = engine.submit(prompt(40, seed=610), greedy(0, prompt_logprobs=0), collector)
    short = engine.submit(prompt(1, seed=611), greedy(0, prompt_logprobs=3), collector)
    engine.run_until_done()
    for request_id, length in ((long, 40), (short, 1)):
        (output,) = collector.outputs[request_id]
        assert output.finish_reason == "length" and output.token_ids == [] and output.num_output_tokens == 0
        assert len(output.prompt_logprobs) == length - 1 and all(e.top == [] for e in output.prompt_logprobs)


def test_an_engine_without_prompt_logprobs_programs_refuses_them(chunked_engine):
    with pytest.raises(RequestRejected, match="prompt logprobs are off"):
        chunked_engine.submit(prompt(5, seed=1), greedy(2, prompt_logprobs=1), Collector())


# ---- what batching, chunking and repetition must not change -------------------------------------------

MIXED = [(3, 12), (200, 4), (17, 9), (64, 6), (65, 12), (130, 5), (9, 10), (41, 8)]  # (prompt, max_tokens)


def test_concurrent_requests_match_one_at_a_time(engine, monkeypatch):
    requests = [(prompt(n, seed=i), greedy(m)) for i, (n, m) in enumerate(MIXED)]
    spy = StepSpy(engine.runner, monkeypatch)
    together = generate(engine, requests)
    # The batch really mixed: decode rows of several requests, and chunks beside decode rows.
    assert max(k[0] for k in spy.keys) == 4 and any(k[0] and k[1] for k in spy.keys)
    alone = [generate(engine, [request])[0] for request in requests]
    for (_, max_tokens), got, want in zip(MIXED, together, alone, strict=True):
        assert got.finish_reason == want.finish_reason == "length"
        assert len(got.token_ids) == max_tokens
        assert_same_greedy(got, want)


CHUNKING = [(5, 6), (16, 6), (17, 6), (33, 6), (50, 6), (64, 6), (130, 6)]  # (prompt, max_tokens)


def test_chunked_prefill_matches_unchunked(engine, chunked_engine, monkeypatch):
    requests = [(prompt(n, seed=100 + n), greedy(m)) for n, m in CHUNKING]
    whole_spy, chunked_spy = StepSpy(engine.runner, monkeypatch), StepSpy(chunked_engine.runner, monkeypatch)
    whole = generate(engine, requests)
    chunked = generate(chunked_engine, requests)
    # Prompts up to 64 tokens went in one chunk on `engine`, and in 16-token chunks on `chunked_engine`.
    assert whole_spy.chunk_lengths() == [5, 16, 17, 33, 50, 64, 64, 64, 2]
    assert max(chunked_spy.chunk_lengths()) == 16 and len(chunked_spy.chunk_lengths()) == 1 + 1 + 2 + 3 + 4 + 4 + 9
    for got, want in zip(chunked, whole, strict=True):
        assert_same_greedy(got, want)


def test_short_prompts_that_arrive_together_prefill_in_one_step(engines, tiny_model, engine, monkeypatch):
    """Four short prompts in one prefill-only step (P = 4, each chunk padded to 64 tokens: 256 padded tokens, the
    budget), and three in one step beside a decode row, each continued as it is alone on `engine` (other
    programs: logprobs within LOGPROB_ATOL)."""
    packed = engines.build(tiny_model, compile_now=False, max_batch=4, max_prefill_tokens=256, max_prefill_chunks=4,
                           max_model_len=512)  # fmt: skip
    try:
        requests = [(prompt(n, seed=200 + n), greedy(6)) for n in (7, 20, 33, 60)]
        spy = StepSpy(packed.runner, monkeypatch)
        together = generate(packed, requests)
        assert spy.keys[0] == (0, 4, 64) and [len(c.token_ids) for c in spy.plans[0].prefill] == [7, 20, 33, 60]
        for got, want in zip(together, [generate(engine, [request])[0] for request in requests], strict=True):
            assert_same_greedy(got, want)
        # Three short prompts that arrive while another request decodes prefill in one step beside its row
        # (chunks of up to 256 / 4 = 64 tokens beside decode rows: program (4, 4, 64)).
        decoder, arrivals = (
            (prompt(30, seed=230), greedy(10)),
            [(prompt(n, seed=231 + n), greedy(6)) for n in (9, 25, 50)],
        )
        collector, start = Collector(), len(spy.plans)
        decoder_id = packed.submit(*decoder, collector)
        packed.step()
        ids = [packed.submit(*request, collector) for request in arrivals]
        packed.run_until_done()
        mixed = [
            (key, plan) for key, plan in zip(spy.keys[start:], spy.plans[start:], strict=True) if len(plan.prefill) > 1
        ]
        assert [(key, len(plan.decode), [len(c.token_ids) for c in plan.prefill]) for key, plan in mixed] == [
            ((4, 4, 64), 1, [9, 25, 50])
        ]
        for request_id, request in zip([decoder_id, *ids], [decoder, *arrivals], strict=True):
            assert_same_greedy(collector.result(request_id, len(request[0])), generate(engine, [request])[0])
    finally:
        engines.release(packed)


# One bf16 rounding of the recurrent state (half an ulp: 2^-9 of each element) moves the tiny model's next-token
# logprobs by up to 3e-4 at the first decode step (observed; 8e-3 after 8 steps of accumulated roundings): the
# bound leaves 30x, and stays below the top-2 gaps the test's tokens need.
BF16_STATE_LOGPROB_ATOL = 1e-2


def test_a_bf16_state_pool_halves_the_slots_and_keeps_the_tokens(engines, tiny_model, engine):
    """`mamba_ssm_cache_dtype="bfloat16"`: the slot pool is bf16 and half the bytes; a prompt prefilled in one chunk
    reads no stored state, so its first token and logprobs are bit-identical to `engine`'s; the first decode step
    reads the rounded state, and its logprobs stay within BF16_STATE_LOGPROB_ATOL."""
    bf16 = engines.build(tiny_model, compile_now=False, max_batch=4, max_prefill_tokens=64, max_model_len=512,
                         mamba_ssm_cache_dtype="bfloat16")  # fmt: skip
    try:
        assert bf16.runner.cache.ssm.dtype == jnp.bfloat16
        assert bf16.runner.cache.ssm.nbytes * 2 == engine.runner.cache.ssm.nbytes
        requests = [(prompt(n, seed=400 + n), greedy(2, logprobs=5)) for n in (9, 50)]
        for got, want in zip(generate(bf16, requests), generate(engine, requests), strict=True):
            assert got.token_ids[0] == want.token_ids[0] and got.logprobs[0] == want.logprobs[0]
            first_step, want_step = dict(got.logprobs[1].top), dict(want.logprobs[1].top)
            common = first_step.keys() & want_step.keys()
            assert len(common) >= 4
            for token in common:
                assert abs(first_step[token] - want_step[token]) <= BF16_STATE_LOGPROB_ATOL
            assert any(first_step[token] != want_step[token] for token in common), "the rounding reached nothing"
    finally:
        engines.release(bf16)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7)], ids=["greedy", "seeded"]
)
def test_logprobs_repeat_bit_for_bit_at_batch_one(engine, sampling):
    request = (prompt(37, seed=7), GenerationParams(max_tokens=8, ignore_eos=True, sampling=sampling, logprobs=5))
    first, second = generate(engine, [request])[0], generate(engine, [request])[0]
    assert first.token_ids == second.token_ids and len(first.token_ids) == 8
    for a, b in zip(first.logprobs, second.logprobs, strict=True):
        assert (a.token_id, a.logprob, a.top) == (b.token_id, b.logprob, b.top)
        assert len(a.top) == 5 and [lp for _, lp in a.top] == sorted((lp for _, lp in a.top), reverse=True)
        assert a.logprob <= 0.0 and dict(a.top).get(a.token_id, a.logprob) == a.logprob
    if sampling.greedy:
        assert all(lp.token_id == lp.top[0][0] and lp.logprob == lp.top[0][1] for lp in first.logprobs)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0, top_k=1, seed=3), SamplingParams(temperature=1.0, top_p=1e-6, seed=3)],
    ids=["top_k=1", "top_p=1e-6"],
)
def test_degenerate_sampling_equals_greedy(engine, sampling):
    """The tiny model's next-token distributions are nearly flat (top-1 probability ~0.003 over 512 ids),
    so a filter that kept more than the top token would almost surely change the sequence."""
    prompts = [prompt(n, seed=200 + n) for n in (6, 30, 70)]
    want = generate(engine, [(p, greedy(10)) for p in prompts])
    got = generate(engine, [(p, greedy(10, sampling=sampling)) for p in prompts])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)


def test_seeded_sampling_repeats_alone_and_in_a_batch(engine):
    p = prompt(25, seed=11)
    request = (p, GenerationParams(max_tokens=32, ignore_eos=True, sampling=SEEDED, logprobs=1))
    alone, again = generate(engine, [request])[0], generate(engine, [request])[0]
    assert alone.token_ids == again.token_ids
    # The seeded request shares steps with other requests (sampled with other seeds, and greedy), sits in
    # another row, and is admitted while others decode.
    others = [
        (prompt(90, seed=12), GenerationParams(max_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, seed=5))),
        (prompt(8, seed=13), GenerationParams(max_tokens=40, ignore_eos=True, sampling=SamplingParams(0.7, seed=6))),
        (prompt(33, seed=14), greedy(12)),
    ]
    batch = generate(engine, [others[0], others[1], request, others[2]])
    assert batch[2].token_ids == alone.token_ids
    # Two independent draws agree at a position with probability <= the largest sampling probability there.
    # At temperature 1 every top-1 probability is < 0.05 (checked below); temperature 0.8 and the top_p=0.9
    # renormalisation raise it to at most 0.05^1.25 * 512^0.25 / 0.9 < 0.13 (sum of p_i^1.25 over 512 ids
    # is >= 512^-0.25). So 17 or more agreements out of 32 have probability < C(32, 17) * 0.13^17 < 1e-6.
    assert max(np.exp(lp.top[0][1]) for lp in alone.logprobs) < 0.05
    other_seed = dataclasses.replace(request[1], sampling=dataclasses.replace(SEEDED, seed=4321))
    reseeded = generate(engine, [(p, other_seed)])[0]
    assert sum(a == b for a, b in zip(alone.token_ids, reseeded.token_ids, strict=True)) <= 16
    # and sampling happened at all: the seeded sequence is not the greedy one
    assert alone.token_ids != generate(engine, [(p, greedy(32))])[0].token_ids


def test_samples_of_one_prompt_share_its_prefill(engine, monkeypatch):
    """Three samples of one 90-token prompt (as `n` = 3 submits them): the first prefills 89 tokens, the others take a
    copy of its caches and each feeds the last prompt token itself. Each sample equals the same request run
    alone, which prefills the whole prompt: seeded draws the same tokens, greedy the same tokens, and logprobs
    within LOGPROB_ATOL (the last token is a chunk of its own, another summation order)."""
    p = prompt(90, seed=15)
    params = [sampled(12, seed=40), sampled(12, seed=41), greedy(12)]
    spy = StepSpy(engine.runner, monkeypatch)
    collector = Collector()
    first = engine.submit(p, params[0], collector)
    ids = [first] + [engine.submit(p, q, collector, fork_of=first) for q in params[1:]]
    engine.run_until_done()
    shared = [collector.result(i, len(p)) for i in ids]
    assert sum(spy.chunk_lengths()) == 89 + 3 and sum(len(plan.copies) for plan in spy.plans) == 2
    for got, q in zip(shared, params, strict=True):
        want = generate(engine, [(p, q)])[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= LOGPROB_ATOL


# ---- finish reasons -----------------------------------------------------------------------------------

FINISH_PROMPT = prompt(19, seed=21)


@pytest.fixture(scope="module")
def reference(engine) -> Result:
    """12 greedy tokens of FINISH_PROMPT to the length limit; the stop tests pick their stops from it."""
    result = generate(engine, [(FINISH_PROMPT, greedy(12))])[0]
    assert len(result.token_ids) == 12 and result.finish_reason == "length"
    return result


def first_new_token_index(tokens: list[int], start: int) -> int:
    """An index >= start whose token did not appear before it (so a stop on it fires exactly there)."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_length_finish_and_text(engine, reference):
    assert reference.finish_reason == "length" and reference.error is None
    assert reference.text == engine.tokenizer.decode(reference.token_ids)


def test_stop_token_id_finishes_with_stop(engine, reference):
    k = first_new_token_index(reference.token_ids, 3)
    params = greedy(12, stop_token_ids=(reference.token_ids[k],))
    result = generate(engine, [(FINISH_PROMPT, params)])[0]
    assert result.finish_reason == "stop"
    assert result.token_ids == reference.token_ids[: k + 1]  # the stop token is delivered, its text is not
    assert result.text == engine.tokenizer.decode(reference.token_ids[:k])


def test_eos_finishes_unless_ignored(engine, reference, monkeypatch):
    assert engine.eos_token_ids == {2, 0}  # the tiny config's EOS ids
    # Random weights never pick the real EOS ids in 12 tokens, so make one of the reference tokens an EOS id.
    k = first_new_token_index(reference.token_ids, 4)
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({reference.token_ids[k]}))
    stopped, ignored = generate(engine, [(FINISH_PROMPT, greedy(12, ignore_eos=False)), (FINISH_PROMPT, greedy(12))])
    assert stopped.finish_reason == "stop" and stopped.token_ids == reference.token_ids[: k + 1]
    assert stopped.text == engine.tokenizer.decode(reference.token_ids[:k])
    assert ignored.finish_reason == "length" and ignored.token_ids == reference.token_ids


def test_stop_string_finishes_and_truncates_text(engine, reference):
    text = reference.text
    # A two-character printable stop string that first appears in the middle of the reference text.
    at = next(
        i for i in range(3, len(text) - 4) if text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2]
        and text.find(text[i : i + 2]) == i
    )  # fmt: skip
    stop = text[at : at + 2]
    result = generate(engine, [(FINISH_PROMPT, greedy(12, stop=(stop,)))])[0]
    assert result.finish_reason == "stop"
    assert result.text == text[:at] and stop not in result.text
    assert result.token_ids == reference.token_ids[: len(result.token_ids)] and len(result.token_ids) < 12


# ---- cancellation and leaks ---------------------------------------------------------------------------


def test_abort_mid_prefill(chunked_engine):
    engine = chunked_engine
    follow_up = (prompt(20, seed=31), greedy(6))
    before = generate(engine, [follow_up])[0]
    collector = Collector()
    rid = engine.submit(prompt(150, seed=32), greedy(4), collector)
    engine.step()  # admits the request and launches its first 16-token chunk
    request = engine.scheduler.running[rid]
    assert request.num_computed_tokens == 16 and request.remaining_prompt == 134
    engine.abort(rid)
    engine.run_until_done()
    result = collector.result(rid)
    assert result.finish_reason == "abort" and result.token_ids == []
    assert engine.scheduler.page_pool.num_free == engine.scheduler.page_pool.num_total
    # The follow-up gets the slot the aborted prompt left half-filled; its first chunk must start from a
    # clean state, so it matches the run before bit for bit (same slot, pages, batch and programs).
    after = generate(engine, [follow_up])[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_abort_mid_decode(engine):
    collector = Collector()
    p_abort, p_keep = prompt(12, seed=33), prompt(7, seed=34)
    rid = engine.submit(p_abort, greedy(100), collector)
    keep = engine.submit(p_keep, greedy(12), collector)
    while len(collector.tokens(rid)) < 3:
        engine.step()
    delivered = collector.tokens(rid)
    engine.abort(rid)
    engine.run_until_done()
    result = collector.result(rid)
    assert result.finish_reason == "abort"
    assert result.token_ids == delivered  # the token of the step in flight at the abort is dropped
    kept = collector.result(keep)
    assert kept.finish_reason == "length" and len(kept.token_ids) == 12
    assert_same_greedy(kept, generate(engine, [(p_keep, greedy(12))])[0])


def test_abort_queued_and_unstarted_requests(engine):
    collector = Collector()
    running = [engine.submit(prompt(10, seed=40 + i), greedy(6), collector) for i in range(4)]
    queued = engine.submit(prompt(10, seed=44), greedy(6), collector)
    engine.step()  # four admitted (max_batch), the fifth waits
    assert [r.request_id for r in engine.scheduler.waiting] == [queued]
    engine.abort(queued)
    unstarted = engine.submit(prompt(10, seed=45), greedy(6), collector)
    engine.abort(unstarted)  # before the loop ever saw it
    engine.abort("no-such-request")  # harmless
    engine.run_until_done()
    for rid in (queued, unstarted):
        assert collector.result(rid).finish_reason == "abort" and collector.tokens(rid) == []
    for rid in running:
        assert collector.result(rid).finish_reason == "length" and len(collector.tokens(rid)) == 6


def test_threaded_loop_serves_aborts_and_shuts_down(tiny_model, engines):
    """start / abort / shutdown, on an engine of its own because shutdown is final for the loop thread. Its
    config is `chunked_engine`'s, so the programs it compiles on first use load from the compile cache."""
    engine = engines.build(tiny_model, compile_now=False, max_batch=4, max_prefill_tokens=16, max_model_len=512)
    try:
        collector = Collector()
        engine.start()
        short = engine.submit(prompt(9, seed=50), greedy(5), collector)
        aborted = engine.submit(prompt(9, seed=51), greedy(400), collector)
        collector.wait(lambda: len(collector.tokens(aborted)) >= 2)
        engine.abort(aborted)
        collector.wait(lambda: collector.is_finished(aborted) and collector.is_finished(short))
        cut = engine.submit(prompt(9, seed=52), greedy(400), collector)
        collector.wait(lambda: len(collector.tokens(cut)) >= 1)
        engine.shutdown()  # drains the step in flight, then ends every live request
        assert collector.result(short).finish_reason == "length" and len(collector.tokens(short)) == 5
        assert collector.result(aborted).finish_reason == "abort"
        ended = collector.result(cut)
        assert ended.finish_reason == "abort" and ended.error == "engine shut down"
        # A request the loop never picked up (here: submitted after the loop ended) is ended too.
        late = engine.submit(prompt(9, seed=53), greedy(4), collector)
        engine.shutdown()
        assert collector.result(late).finish_reason == "abort" and collector.tokens(late) == []
    finally:
        engine.shutdown()
        engines.release(engine)
    assert engine.scheduler.page_pool.num_free == engine.scheduler.page_pool.num_total
    assert engine.scheduler.slot_pool.num_free == engine.scheduler.slot_pool.num_total
    assert not engine.generations


# ---- compiles -----------------------------------------------------------------------------------------


def spy_row_programs(runner, monkeypatch) -> list[tuple[str, int]]:
    """The (kind, output rows) of every row program the runner launches from now on (appended as they run)."""
    used, row_program = [], runner.row_program

    def spy(kind, r):
        used.append((kind, r))
        return row_program(kind, r)

    monkeypatch.setattr(runner, "row_program", spy)
    return used


def test_every_step_program_takes_its_inputs_as_one_host_array(engine):
    """Each host array a call hands over costs the launch its own transfer, so every step program takes the step's
    inputs packed in one int32 array, besides the weights, the caches and the token state."""
    runner = engine.runner
    num_state = len(jax.tree.leaves((runner._param_leaves, runner.cache, runner.token_state)))
    for key in runner.buckets.keys():
        args = jax.tree.leaves(runner.executables[key].args_info)
        assert len(args) == num_state + 1, key
        assert args[-1].shape == (runner.input_layout(key).size,) and args[-1].dtype == jnp.int32, key


def test_serving_compiles_nothing_new(engine, monkeypatch):
    """A workload that runs every bucket program (prefill-only, decode-only and unified, at every B and T), every
    row program (sampled decoders and top logprobs at every output row count, the prompt-token marker, the prefix
    copy) and every
    prompt-logprobs program compiles nothing: no new runner program and no XLA compile or cache load at all."""
    runner = engine.runner
    assert set(runner.compile_seconds) == set(runner.buckets.keys()) and runner.num_compiles == 9
    every_row_program = {(kind, r) for kind in ("sample", "top") for r in (1, 2, 3, 4, 5)}
    every_row_program |= {("mark_prompt", 64), ("copy_prefix", 1)}
    assert set(runner.row_compile_seconds) == set(runner.buckets.row_programs()) == every_row_program
    assert set(runner.prompt_compile_seconds) == {16, 32}
    before = runner.num_compiles
    backend_compiles = []
    row_programs_used = spy_row_programs(runner, monkeypatch)
    prompt_programs_used, prompt_program = [], runner.prompt_program
    monkeypatch.setattr(runner, "prompt_program", lambda t: prompt_programs_used.append(t) or prompt_program(t))

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            backend_compiles.append(kwargs)

    spy = StepSpy(runner, monkeypatch)
    collector = Collector()
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        # Prefill-only steps at T = 16, 32, 64 (max_tokens=1: these never decode).
        for n in (10, 20, 40):
            engine.submit(prompt(n, seed=60 + n), greedy(1), collector)
        engine.run_until_done()
        # With 1, 2 and 3 requests decoding, one prompt per chunk bucket: unified steps at B = 1, 2, 4.
        for num_decoding in (1, 2, 3):
            decoders = [
                engine.submit(prompt(5, seed=70 + i), sampled(30, seed=i), collector) for i in range(num_decoding)
            ]
            while any(engine.scheduler.running[r].remaining_prompt for r in decoders if r in engine.scheduler.running):
                engine.step()
            engine.step()  # a decode-only step at this B
            prefills = [engine.submit(prompt(n, seed=80 + n), greedy(1), collector) for n in (10, 20, 40)]
            while not all(collector.is_finished(r) for r in prefills):
                engine.step()
            for rid in decoders:
                engine.abort(rid)
            engine.run_until_done()
        # A scored prompt in chunks of 32 and 8 (T = 32, 16), beside a prompt under a repetition penalty.
        engine.submit(prompt(40, seed=90), greedy(2, prompt_logprobs=1), collector)
        engine.submit(prompt(12, seed=91), greedy(2, sampling=SamplingParams(repetition_penalty=1.2)), collector)
        engine.run_until_done()
        # Two samples of one prompt: the second takes a copy of the first's prefix.
        first = engine.submit(prompt(30, seed=92), greedy(2), collector)
        engine.submit(prompt(30, seed=92), greedy(2), collector, fork_of=first)
        engine.run_until_done()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert set(spy.keys) == set(runner.buckets.keys())  # every program served a real step
    assert set(row_programs_used) == every_row_program  # and every row program
    assert set(prompt_programs_used) == {16, 32}  # and every prompt-logprobs program
    assert runner.num_compiles == before and set(runner.compile_seconds) == set(runner.buckets.keys())
    assert set(runner.row_compile_seconds) == every_row_program
    assert backend_compiles == []
    assert all(o.error is None for outputs in collector.outputs.values() for o in outputs)


# ---- failures and rejections --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["launch", "launch_cache_lost", "fetch"])
def test_step_error_fails_only_its_requests(engine, monkeypatch, where):
    """A and B are admitted together; A's prefill step (the first) fails. A must finish with "error" and a
    message, B and a later request must complete. When the failed launch consumed the donated caches,
    every request holding a slot fails (B too) and the engine restarts from fresh caches."""
    p_a, p_b, p_later = prompt(10, seed=90), prompt(11, seed=91), prompt(12, seed=92)
    want_b, want_later = generate(engine, [(p_b, greedy(5))])[0], generate(engine, [(p_later, greedy(5))])[0]
    failures = []

    def fail(message: str) -> None:
        failures.append(message)
        raise RuntimeError(message)

    if where == "fetch":
        fetch = StepHandle.fetch
        monkeypatch.setattr(StepHandle, "fetch", lambda h: fetch(h) if failures else fail("injected fetch failure"))
    else:
        launch = engine.runner.launch

        def failing_launch(plan, sampling):
            if failures:
                return launch(plan, sampling)
            if where == "launch_cache_lost":
                engine.runner.cache.k_pages.delete()  # what a launch that failed after donating leaves
            fail("injected launch failure")

        monkeypatch.setattr(engine.runner, "launch", failing_launch)
    collector = Collector()
    a, b = engine.submit(p_a, greedy(5), collector), engine.submit(p_b, greedy(5), collector)
    engine.run_until_done()
    assert len(failures) == 1
    result_a = collector.result(a)
    assert result_a.finish_reason == "error" and failures[0] in result_a.error and result_a.token_ids == []
    result_b = collector.result(b)
    if where == "launch_cache_lost":
        assert result_b.finish_reason == "error" and failures[0] in result_b.error
        assert not engine.runner.cache_lost()
    else:
        assert result_b.finish_reason == "length"
        assert_same_greedy(result_b, want_b)
    later = generate(engine, [(p_later, greedy(5))])[0]
    assert later.token_ids == want_later.token_ids and later.logprobs == want_later.logprobs


def test_bad_requests_are_rejected_at_submit(engine, engines, tiny_model):
    collector = Collector()
    with pytest.raises(RequestRejected, match="empty"):
        engine.submit([], greedy(4), collector)
    with pytest.raises(RequestRejected, match="max_tokens must be at least 0"):
        engine.submit(prompt(5, seed=1), greedy(-1), collector)
    with pytest.raises(RequestRejected, match="exceeds the maximum model length of 512"):
        engine.submit(prompt(500, seed=1), greedy(13), collector)
    engine.check(500, 12)  # exactly max_model_len fits
    # A pool smaller than one max_model_len sequence: 8 allocatable pages of 16 tokens = 128 tokens.
    small = engines.build(tiny_model, compile_now=False, max_batch=2, max_prefill_tokens=16, max_model_len=512,
                          num_pages=9)  # fmt: skip
    try:
        with pytest.raises(RequestRejected, match="whole KV cache holds 8"):
            small.submit(prompt(100, seed=1), greedy(29), collector)
        small.check(100, 28)
        assert not small.has_work() and small.runner.num_compiles == 0
    finally:
        engines.release(small)
    assert not engine.has_work() and not collector.outputs


def test_duplicate_live_request_id_is_rejected(engine):
    collector = Collector()
    engine.submit(prompt(5, seed=2), greedy(3), collector, request_id="same")
    with pytest.raises(RequestRejected, match="already in use"):
        engine.submit(prompt(5, seed=3), greedy(3), collector, request_id="same")
    engine.run_until_done()
    assert collector.result("same").finish_reason == "length"
    engine.submit(prompt(5, seed=3), greedy(3), collector, request_id="again")  # a finished id is free again
    engine.run_until_done()


# ---- device sampling ----------------------------------------------------------------------------------


def sample(logits, rows: SamplingRows, num_top: int):
    """What the runner's programs compute for a step, in one function: greedy (the step program), the draw for
    sampled rows (the sampler program) and the top logprobs (the top program) -> (tokens, token logprob, top ids,
    top logprobs). The runner launches the last two only when a row samples or asks for top logprobs."""
    tokens, _ = device_sampling.resample(logits, rows, device_sampling.greedy(logits)[0])
    return tokens, *device_sampling.top_logprobs(logits, tokens, num_top)


sample_jit = jax.jit(sample, static_argnums=2)


def sampling_rows(n: int, **columns) -> SamplingRows:
    """n rows; each column a scalar for every row or a length-n sequence."""
    defaults = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, output_index=0)
    values = {k: np.broadcast_to(np.asarray(v), (n,)) for k, v in (defaults | columns).items()}
    return SamplingRows.from_rows([SamplingRow(**{k: v[i].item() for k, v in values.items()}) for i in range(n)], n,
                                  all_allowed(n))  # fmt: skip


def all_allowed(n: int) -> np.ndarray:
    """Masks that allow every token of every vocabulary these tests use (512 tokens at most)."""
    return np.full((n, device_sampling.mask_words(512)), -1, np.int32)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = random_logits(8, 300, seed=0)
    temperature = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3, 0.0, 0.0]
    tokens, *_ = sample_jit(logits, sampling_rows(8, temperature=temperature, seed=np.arange(8)), 4)
    greedy_rows = [i for i, t in enumerate(temperature) if t == 0.0]
    assert np.asarray(tokens)[greedy_rows].tolist() == np.argmax(logits[greedy_rows], axis=-1).tolist()
    # Padding rows from `from_rows` are greedy.
    padded = SamplingRows.from_rows([SamplingRow(1.0, 0, 1.0, 0.0, 1, 0)], pad_to=8, allowed=all_allowed(8))
    tokens, *_ = sample_jit(logits, padded, 4)
    assert np.asarray(tokens)[1:].tolist() == np.argmax(logits[1:], axis=-1).tolist()


def test_seeded_noise_belongs_to_token_ids_not_ranks():
    """Raising one logit by 1e-3 moves it to rank 0 among equal logits, and every token before it down one rank.
    The draw must not change unless that token wins by less than 1e-3 (probability ~1e-3 per draw): the noise
    of a token is a function of (seed, output index, token id), so a batch-dependent reordering of near-tied
    logits cannot move it to other tokens."""
    vocab, draws = 64, 32
    flat = np.zeros((draws, vocab), np.float32)
    nudged = flat.copy()
    nudged[:, vocab // 2] += 1e-3
    rows = sampling_rows(draws, temperature=1.0, seed=np.arange(draws) + 100, output_index=2)
    a, b = (np.asarray(sample_jit(logits, rows, 1)[0]) for logits in (flat, nudged))
    assert len(set(a.tolist())) > 8  # the draws really vary with the seed
    assert (a == b).sum() >= draws - 1, (a, b)


def test_logit_bias_moves_greedy_and_sampled_picks_and_leaves_logprobs_unbiased():
    """Against the host reference: the pick is the argmax of logits + bias; logprobs are of the logits."""
    logits = random_logits(4, 300, seed=5)
    rows = SamplingRows.from_rows([SamplingRow(0.0, 0, 1.0, 0.0, 0, 0, 0, ((7, 100.0),)),
                                   SamplingRow(0.0, 0, 1.0, 0.0, 0, 0, 0, ((int(np.argmax(logits[1])), -100.0),)),
                                   SamplingRow(1.0, 0, 1.0, 0.0, 3, 0, 0, ((11, 100.0),)),
                                   SamplingRow(0.0, 0, 1.0, 0.0, 0, 0)], 4, all_allowed(4))  # fmt: skip
    tokens, chosen, *_ = (np.asarray(x) for x in sample_jit(logits, rows, 1))
    reference = logits.astype(np.float64).copy()
    reference[0, 7] += 100.0
    reference[1, np.argmax(logits[1])] -= 100.0
    assert tokens.tolist() == [7, int(np.argmax(reference[1])), 11, int(np.argmax(logits[3]))]
    np.testing.assert_allclose(chosen, log_softmax(logits)[np.arange(4), tokens], atol=1e-5)  # fp32 logsumexp


def test_seeds_differ_in_their_high_bits():
    """Seeds that share their low 32 bits draw differently: the whole 64-bit seed keys the noise."""
    seeds = [1, 2**32 + 1, -(2**32) + 1, 2**63 - 1, -(2**63)]
    logits = np.zeros((8, 512), np.float32)
    draws = [np.asarray(sample_jit(logits, sampling_rows(8, temperature=1.0, seed=seed, output_index=np.arange(8)),
                                   1)[0]).tolist() for seed in seeds]  # fmt: skip
    assert len({tuple(d) for d in draws}) == len(seeds), draws


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(min_p=0.99), dict(top_p=1e-6)], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_filters_that_keep_one_token_equal_the_argmax(filters, temperature):
    logits = random_logits(256, 64, seed=1)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    # min_p=0.99 keeps only tokens with p >= 0.99 p_max, i.e. within 0.01 * T of the top logit: make the gap
    # wider for every row.
    logits[np.arange(256), np.argmax(logits, axis=-1)] += np.maximum(0.0, 0.05 - (top2[:, 1] - top2[:, 0]))
    rows = sampling_rows(256, temperature=temperature, seed=np.arange(256), output_index=7, **filters)
    tokens, *_ = sample_jit(logits, rows, 4)
    assert np.asarray(tokens).tolist() == np.argmax(logits, axis=-1).tolist()


# 40,000 independent draws (distinct seeds) from one row of logits. The Pearson statistic over k bins is
# ~chi-square with k-1 dof; the bounds are its 1e-6 upper quantiles (scipy.stats.chi2.isf(1e-6, k - 1)), so
# a correct sampler fails with probability 1e-6 (and, the seeds being fixed, deterministically passes).
# At this N a bin off by 1.5 percentage points already pushes the statistic past the bound.
NUM_DRAWS = 40_000
CHI2_BOUND_1E6 = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52}
FLAT8 = np.array([1.0, 0.5, 0.0, -0.3, -1.0, 0.2, 0.8, -2.0], np.float32)


def empirical_counts(logits: np.ndarray, **sampling) -> np.ndarray:
    rows = sampling_rows(NUM_DRAWS, seed=np.arange(NUM_DRAWS), output_index=3, **sampling)
    tokens, *_ = sample_jit(np.broadcast_to(logits, (NUM_DRAWS, logits.size)), rows, 2)
    return np.bincount(np.asarray(tokens), minlength=logits.size)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = NUM_DRAWS * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_one_draws_follow_the_softmax():
    probs = np.exp(log_softmax(FLAT8))
    counts = empirical_counts(FLAT8, temperature=1.0)
    assert chi_square(counts, probs) < CHI2_BOUND_1E6[len(probs) - 1]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.7), SamplingParams(1.0, min_p=0.3)],
    ids=["top_k", "top_p", "min_p"],
)
def test_filtered_draws_follow_the_host_oracle(params):
    """Each filter against `sampling.filtered_probs`: nothing drawn outside the kept set, and the kept
    tokens' frequencies follow the oracle's renormalised probabilities."""
    probs = filtered_probs(FLAT8, params)
    kept = probs > 0
    assert 1 < kept.sum() < len(FLAT8) - 1  # the filter cuts, and leaves a distribution to test
    fields = dataclasses.asdict(params)
    del fields["seed"], fields["logit_bias"]
    counts = empirical_counts(FLAT8, **fields)
    assert counts[~kept].sum() == 0
    assert chi_square(counts[kept], probs[kept]) < CHI2_BOUND_1E6[int(kept.sum()) - 1]


def test_logprobs_are_the_log_softmax():
    logits = random_logits(6, 300, seed=2)
    rows = sampling_rows(6, temperature=[0.0, 1.0, 0.5, 0.0, 2.0, 1.0], top_k=[0, 0, 10, 0, 0, 3], seed=np.arange(6))
    tokens, chosen, top_ids, top_lp = (np.asarray(x) for x in sample_jit(logits, rows, 20))
    want = log_softmax(logits)
    # fp32 log_softmax of logits of magnitude ~10: a few ulps of the log-sum-exp.
    np.testing.assert_allclose(chosen, want[np.arange(6), tokens], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(top_ids, np.argsort(-want, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(top_lp, np.take_along_axis(want, top_ids, axis=-1), atol=2e-5, rtol=0)


@pytest.mark.parametrize("rows", [4, device_sampling.ONE_PASS_GREEDY_ROWS])  # both of greedy's forms
def test_greedy_takes_the_first_argmax_and_its_log_softmax(rows):
    logits = random_logits(rows, 5000, seed=3, scale=10.0)
    logits[1, [7, 4000]] = logits[1].max() + 1.0  # tied maxima: the lower index wins, as np.argmax
    logits[2] = 0.5  # a flat row: token 0, logprob -log(5000)
    logits[3, 123] = 200.0  # one token holds all the mass: its logprob rounds to 0, not to a NaN
    tokens, chosen = (np.asarray(x) for x in jax.jit(device_sampling.greedy)(logits))
    assert tokens.tolist() == np.argmax(logits, axis=-1).tolist()
    assert tokens[1:4].tolist() == [7, 0, 123]
    want = log_softmax(logits.astype(np.float64))[np.arange(rows), tokens]
    # fp32, rescaling partial sums as the max grows: a few ulps of a log-sum-exp of ~10 (2e-5, as the test above).
    np.testing.assert_allclose(chosen, want, atol=2e-5, rtol=0)


def test_draws_depend_on_seed_and_output_index_not_on_the_row():
    """Randomness is keyed by (seed, output index): the same keys give the same tokens in any row order and
    beside any other rows; another output index gives other tokens."""
    flat = random_logits(1, 512, seed=3, scale=0.2)  # nearly flat over 512 ids
    keyed = dict(temperature=np.ones(64), seed=np.arange(64) + 1000, output_index=np.arange(64) % 5)
    tokens = np.asarray(sample_jit(np.repeat(flat, 64, axis=0), sampling_rows(64, **keyed), 2)[0])
    # The same 64 rows shuffled among 32 others (greedy, and sampled with their own seeds).
    others = dict(temperature=np.r_[np.zeros(16), np.full(16, 0.5)], seed=np.arange(32) + 5000,
                  output_index=np.zeros(32, int))  # fmt: skip
    order = np.random.default_rng(4).permutation(96)
    columns = {k: np.concatenate([keyed[k], others[k]])[order] for k in keyed}
    batch = np.asarray(sample_jit(np.repeat(flat, 96, axis=0), sampling_rows(96, **columns), 2)[0])
    assert batch[np.argsort(order)[:64]].tolist() == tokens.tolist()
    moved = sampling_rows(64, **(keyed | dict(output_index=keyed["output_index"] + 1)))
    other = np.asarray(sample_jit(np.repeat(flat, 64, axis=0), moved, 2)[0])
    # Two independent draws from a nearly flat 512-way distribution agree with probability ~1/500.
    assert (other != tokens).sum() > 48


def test_host_error_in_the_loop_fails_live_requests_and_keeps_serving(tiny_model, engines, monkeypatch):
    """An exception outside a device step (a host-side bug) fails the live requests with its message and
    the loop thread carries on serving. Own engine (shutdown is final); programs load from the cache."""
    engine = engines.build(tiny_model, compile_now=False, max_batch=4, max_prefill_tokens=16, max_model_len=512)
    original, calls = engine.scheduler.schedule, []

    def schedule_failing_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scheduler bug")
        return original()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_failing_once)
    try:
        collector = Collector()
        engine.start()
        failed = engine.submit(prompt(9, seed=60), greedy(50), collector)
        collector.wait(lambda: collector.is_finished(failed))
        assert collector.result(failed).finish_reason == "error"
        assert "scheduler bug" in collector.result(failed).error
        assert engine.is_running()
        served = engine.submit(prompt(9, seed=61), greedy(3), collector)
        collector.wait(lambda: collector.is_finished(served))
        assert collector.result(served).finish_reason == "length" and len(collector.tokens(served)) == 3
    finally:
        engine.shutdown()
        engines.release(engine)
    assert engine.scheduler.page_pool.num_free == engine.scheduler.page_pool.num_total
    assert engine.scheduler.slot_pool.num_free == engine.scheduler.slot_pool.num_total


def test_prompts_arriving_during_a_lone_prefill_join_the_next_step(engine, monkeypatch):
    """A prefill-only step launched by an idle engine (a burst's first prompt) is waited for before the next step
    is planned, so prompts that arrive while it runs join the next step beside the first request's decode row,
    not the step after a decode-only one (which held a 16 x 128 burst's TTFT p50 a step longer on the GPU)."""
    collector, ids = Collector(), []
    spy = StepSpy(engine.runner, monkeypatch)
    arrivals = [(prompt(n, seed=240 + n), greedy(3)) for n in (5, 9)]
    process = engine._process

    def process_as_they_arrive(handle):  # the arrivals land while the first step is on the device
        if not ids:
            ids.extend(engine.submit(*request, collector) for request in arrivals)
        return process(handle)

    monkeypatch.setattr(engine, "_process", process_as_they_arrive)
    first = engine.submit(prompt(7, seed=239), greedy(3), collector)
    engine.run_until_done()
    assert not spy.plans[0].decode and [len(c.token_ids) for c in spy.plans[0].prefill] == [7]
    assert [row.request_id for row in spy.plans[1].decode] == [first]
    assert spy.plans[1].prefill and spy.plans[1].prefill[0].request_id == ids[0]
    for request_id in [first, *ids]:
        assert collector.result(request_id).finish_reason == "length"


def test_trace_steps_logs_one_itl_step_line_per_step(engine, caplog):
    collector = Collector()
    engine.trace_steps = True
    try:
        with caplog.at_level(logging.INFO, logger="qwen35_jax.serving.engine"):
            engine.submit(prompt(9, seed=70), greedy(3), collector)
            engine.run_until_done()
    finally:
        engine.trace_steps = False
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ITL_STEP")]
    # one prefill step, then decode steps for the 2 tokens after the first (sampled by the prefill step)
    assert [line.split()[2] for line in lines] == ["plan=prefill", "plan=decode", "plan=decode"]


def test_the_gpu_weight_layout_serves_the_same_tokens(engines, engine, monkeypatch):
    """Per-group weights (the GPU's layout, a Python loop over the groups) give the scan engine's greedy tokens,
    unified steps included (decode rows' states updated in the pool while a prefill chunk's rows are gathered and
    scattered). A model of its own: the layout replaces its params."""
    from qwen35_jax.api import load_model
    from qwen35_jax.model import layout_for_platform

    model = load_model("tiny", dtype="float32")
    model.params = layout_for_platform(model.params, platform="gpu")
    per_group = engines.build(model, max_batch=2, max_prefill_tokens=16, max_model_len=512)
    try:
        spy = StepSpy(per_group.runner, monkeypatch)
        requests = [(prompt(n, seed=400 + n), greedy(m)) for n, m in [(5, 8), (70, 5), (40, 6)]]
        for got, want in zip(generate(per_group, requests), generate(engine, requests), strict=True):
            assert_same_greedy(got, want)
        assert any(b and p for b, p, _ in spy.keys), "no unified step ran"
    finally:
        engines.release(per_group)


def test_the_program_set_at_the_serving_defaults():
    """--max-batch 16, --max-prefill-tokens 1024, --max-prefill-chunks 8: unified programs from a quarter of the
    largest decode bucket, packed prefill-only programs within 1024 padded tokens, and plans mapped to them."""
    buckets = Buckets.for_limits(16, 1024, 8)
    keys = buckets.keys()
    assert buckets.unified_decode == (4, 8, 16) and len(keys) == 5 + 7 + 9 + 15 + 6 == len(set(keys))
    assert sorted(k for k in keys if k[0] == 0 and k[1] > 1) == [
        (0, 2, 64), (0, 2, 128), (0, 2, 256), (0, 2, 512), (0, 4, 64), (0, 4, 128), (0, 4, 256), (0, 8, 64), (0, 8, 128)
    ]  # fmt: skip
    # Beside decode rows, chunks of up to 1024 / 8 = 128 tokens, at the largest decode bucket only.
    assert sorted(k for k in keys if k[0] and k[1] > 1) == [
        (16, 2, 64), (16, 2, 128), (16, 4, 64), (16, 4, 128), (16, 8, 64), (16, 8, 128)
    ]  # fmt: skip

    def chunk(length: int) -> PrefillChunk:
        return PrefillChunk("p", 0, 0, tuple(range(length)), (1,), True)

    row = DecodeRow("d", 1, 5, (2,))
    assert buckets.key_for(StepPlan(0, (row,), (chunk(30),), "unified", 30)) == (4, 1, 64)
    assert buckets.key_for(StepPlan(0, (row,) * 3, (), "decode", 0)) == (4, 0, 0)
    assert buckets.key_for(StepPlan(0, (), (chunk(100),) * 3, "prefill", 300)) == (0, 4, 128)
    assert buckets.key_for(StepPlan(0, (), (chunk(10),) * 5, "prefill", 50)) == (0, 8, 64)
    assert buckets.key_for(StepPlan(0, (row,), (chunk(10),) * 2, "unified", 20)) == (16, 2, 64)
    assert buckets.key_for(StepPlan(0, (row,) * 9, (chunk(100),) * 5, "unified", 500)) == (16, 8, 128)
    with pytest.raises(ValueError, match="beside 2 prompt chunks of up to 200 tokens"):
        buckets.key_for(StepPlan(0, (row,), (chunk(200), chunk(10)), "unified", 210))
    stream = Buckets.for_limits(16, 1024, 8, pack_beside_decode=False)
    assert not [k for k in stream.keys() if k[0] and k[1] > 1]
    with pytest.raises(ValueError, match="beside 2 prompt chunks"):
        stream.key_for(StepPlan(0, (row,), (chunk(10),) * 2, "unified", 20))
    with pytest.raises(ValueError, match="exceed the largest chunk"):
        buckets.key_for(StepPlan(0, (), (chunk(300),) * 3, "prefill", 900))


def test_programs_have_no_device_branch(engine):
    """No step or sampler program branches on a device value: XLA's GPU runtime runs a `conditional` by
    copying its predicate to the host and waiting for it inside the launch, so a branch would make the host
    wait for the step it just launched (what the "any row samples" lax.cond did; docs/performance.md)."""
    runner = engine.runner
    programs = [*runner.executables.values(), *runner.row_executables.values(), *runner.prompt_executables.values()]
    assert len(programs) == len(runner.buckets.keys()) + len(runner.buckets.row_programs()) + 2
    for program in programs:
        assert " conditional(" not in program.as_text()


def test_top_logprobs_run_only_when_asked(engine, monkeypatch):
    """The full-vocabulary top-k runs only in steps where a request asked for top logprobs: without logprobs,
    or with logprobs=0 (the chosen token's only), no row program runs for a greedy request; the tokens and the
    chosen logprobs are those of a request that asked for the top 3, to 1e-5: the same formula compiled in two
    programs sums the vocabulary's (512 terms here) fp32 logsumexp in another order (a few ulps of |logprob| ~ 6)."""
    used = spy_row_programs(engine.runner, monkeypatch)
    p = prompt(20, seed=500)
    plain, chosen_only = generate(
        engine, [(p, GenerationParams(6, ignore_eos=True))] * 1 + [(p, greedy(6, logprobs=0))]
    )
    assert used == []
    assert plain.logprobs == [] and [lp.top for lp in chosen_only.logprobs] == [[]] * 6
    with_top = generate(engine, [(p, greedy(6, logprobs=3))])[0]
    assert used and {kind for kind, _ in used} == {"top"}
    assert plain.token_ids == chosen_only.token_ids == with_top.token_ids
    for a, b in zip(chosen_only.logprobs, with_top.logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-5 and len(b.top) == 3
        assert b.top[0] == (b.token_id, b.logprob)  # greedy: the chosen token heads the list, same value
