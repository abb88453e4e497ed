"""`--decode-overlap stream` on the CPU with the tiny fp32 model: the scheduling it changes, end to end.

On a CPU `stream` compiles the programs of `off` (XLA:CPU has no command buffers: `runner.overlaps_sides`), so what
differs is the host: a chunk beside decode rows is capped by `scheduler.overlap_budget`, `auto` does not defer
prefill for a finishing decoder, plans are named `overlap_launch` / `overlap_decode`, and the engine blocks on an
in-flight overlapped step when its last decoder retires (`overlap_wait`). The tests check that the same plans give
the same bits as `off`, that each mode's own plans give the same greedy tokens, that cancelling, shutting down and
failing a step while an overlapped step is in flight lose nothing and leak nothing, and the exact step trace.

Engines: `off_engine` has `test_engine.engine`'s limits, so in one session its 15 programs load from the compile
cache; `stream_engine` loads the same programs, measures them (as `serve` does), then takes a fixed budget of 16
prompt tokens beside any decode rows (`BUDGET`) in place of the timed one, so that plans do not depend on timing.
Prefill-only steps still take the whole 64-token cap.

Tolerances are test_engine's: runs that differ only in summation order (16- against 64-token chunks, a decode
row in a unified program against a decode-only one) agree to LOGPROB_ATOL, and a greedy argmax may flip only
under a TIE_GAP top-2 gap (`assert_same_greedy`). Runs of the same plans through the same programs agree bit
for bit.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import Collector, StepSpy, assert_same_greedy, greedy, prompt, sampled

from qwen35_jax.serving import runner as runner_module
from qwen35_jax.serving.engine import TokenLogprob
from qwen35_jax.serving.factory import EngineConfig, compile_overlapped
from qwen35_jax.serving.runner import (
    CONCURRENT_GRAPH,
    NO_REMATERIALIZATION,
    PINNED_GEMMS,
    PREFILL_WITHOUT_GRAPHS,
    Buckets,
    Runner,
    StepHandle,
    overlaps_sides,
)
from qwen35_jax.serving.scheduler import OverlapBudget

LIMITS = dict(max_batch=4, max_prefill_tokens=64, max_model_len=512)  # test_engine's `engine`: shared programs
CHUNK_BESIDE_DECODE = 16
BUDGET = OverlapBudget(((1, CHUNK_BESIDE_DECODE), (2, CHUNK_BESIDE_DECODE), (4, CHUNK_BESIDE_DECODE)))
ENGINE_LOG = "qwen35_jax.serving.engine"
HANG_GUARD_S = 30.0  # joins and waits on the loop thread: only keeps a broken engine from hanging the run


# ---- engines ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def off_engine(engines, tiny_model):
    engine = engines.build(tiny_model, **LIMITS)
    yield engine
    engines.release(engine)


@dataclasses.dataclass
class StreamBuild:
    engine: object
    measured: OverlapBudget | None  # what build_engine sized from the measured step costs


@pytest.fixture(scope="module")
def stream_build(engines, tiny_model, off_engine) -> StreamBuild:
    """Built after `off_engine`, so its programs load from the compile cache."""
    engine = engines.build(tiny_model, decode_overlap="stream", **LIMITS)
    measured, engine.scheduler.overlap_budget = engine.scheduler.overlap_budget, BUDGET
    yield StreamBuild(engine, measured)
    engines.release(engine)


@pytest.fixture
def stream_engine(stream_build):
    return stream_build.engine


# ---- helpers ------------------------------------------------------------------------------------------


def mixed_requests(n: int, seed: int, sampled_every: int = 0) -> list:
    """n requests with prompts of 5..130 tokens (most longer than a chunk beside decoders, some longer than the
    64-token cap) and 3..10 output tokens; every `sampled_every`-th one seeded-sampled, the rest greedy."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        length, max_tokens = int(rng.integers(5, 131)), int(rng.integers(3, 11))
        params = sampled(max_tokens, seed=seed + i) if sampled_every and i % sampled_every == 0 else greedy(max_tokens)
        requests.append((prompt(length, seed=seed * 1000 + i), params))
    return requests


class LaunchRecorder:
    """Wraps `runner.launch`: every launched step's plan, sampling rows and handle, in launch order."""

    def __init__(self, runner, monkeypatch):
        self.steps: list[tuple] = []
        launch = runner.launch

        def record(plan, sampling):
            handle = launch(plan, sampling)
            self.steps.append((plan, sampling, handle))
            return handle

        monkeypatch.setattr(runner, "launch", record)

    @property
    def plans(self) -> list:
        return [plan for plan, _, _ in self.steps]


def real_rows(handle: StepHandle, outputs: tuple) -> list:
    """The outputs of the plan's own rows: padding rows read and write the trash slot, whose contents are
    garbage by contract (another history leaves other garbage there)."""
    rows = [i for i, _ in handle.output_rows()]
    return [None if x is None else x[rows] for x in outputs]


def replay(runner, steps: list[tuple], logprobs: dict[str, int]) -> dict[str, list[TokenLogprob]]:
    """Launches recorded steps, in order, through another runner and checks every plan row's outputs against the
    recording bit for bit; returns each request's sampled tokens as the engine would deliver them."""
    delivered = collections.defaultdict(list)
    for plan, sampling, recorded in steps:
        handle = runner.launch(plan, sampling)
        outputs = handle.fetch()
        for name, got, want in zip(("tokens", "logprobs", "top ids", "top logprobs"), real_rows(handle, outputs),
                                   real_rows(recorded, recorded.fetch()), strict=True):  # fmt: skip
            what = f"step {plan.step_id} ({plan.action}): {name}"
            assert (got is None) == (want is None), what
            assert want is None or (got.dtype == want.dtype and got.tobytes() == want.tobytes()), what
        tokens, chosen, top_ids, top_lp = outputs
        for i, row in handle.output_rows():
            if getattr(row, "is_last", True):
                n = logprobs[row.request_id]
                top = [(int(t), float(v)) for t, v in zip(top_ids[i][:n], top_lp[i][:n], strict=True)] if n else []
                delivered[row.request_id].append(TokenLogprob(int(tokens[i]), float(chosen[i]), top))
    return delivered


def chunks_beside_decoders(plans) -> list[int]:
    return [len(c.token_ids) for plan in plans if plan.decode for c in plan.prefill]


def is_decoding(engine, request_id: str) -> bool:
    request = engine.scheduler.running.get(request_id)
    return request is not None and request.remaining_prompt == 0


def computed_tokens(engine, request_id: str) -> int:
    request = engine.scheduler.running.get(request_id)
    return 0 if request is None else request.num_computed_tokens


def step_until(engine, predicate, limit: int = 200) -> None:
    for _ in range(limit):
        if predicate():
            return
        engine.step()
    raise AssertionError(f"not reached in {limit} steps")


def run_to_idle(engine, limit: int = 500) -> None:
    """run_until_done with a bound: an engine that lost a step would otherwise step forever."""
    step_until(engine, lambda: not engine.has_work(), limit)


def generate(engine, requests: list) -> list:
    """test_engine's `generate` (submit all, run to idle, results in order) with run_to_idle's bound."""
    collector = Collector()
    ids = [engine.submit(p, params, collector) for p, params in requests]
    run_to_idle(engine, limit=2000)
    return [collector.result(rid, len(p)) for rid, (p, _) in zip(ids, requests, strict=True)]


def trace_actions(caplog) -> list[tuple[int, str]]:
    """(step id, action) of every ITL_STEP line, in order."""
    lines = [r.getMessage() for r in caplog.records if r.name == ENGINE_LOG and r.getMessage().startswith("ITL_STEP")]
    return [(int(m[1]), m[2]) for m in (re.match(r"ITL_STEP step=(\d+) plan=(\w+)", line) for line in lines)]


def engine_errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ENGINE_LOG and r.levelno >= logging.ERROR]


def assert_idle_and_free(engine) -> None:
    scheduler = engine.scheduler
    assert scheduler.page_pool.num_free == scheduler.page_pool.num_total, "KV pages leaked"
    assert scheduler.slot_pool.num_free == scheduler.slot_pool.num_total, "GDN slots leaked"
    assert not engine.generations and not engine.has_work()


# ---- the build ----------------------------------------------------------------------------------------


class CostedRunner:
    """The two Runner methods compile_overlapped uses, over a table of step costs: records what it compiles."""

    def __init__(self, buckets: Buckets, costs: dict):
        self.buckets, self.costs, self.compiled, self.measured = buckets, costs, [], []

    def compile_all(self, progress=None, keys=None):
        self.compiled += list(self.buckets.keys() if keys is None else keys)

    def measure_step_costs(self, keys):
        assert set(keys) <= set(self.compiled), "measured before compiled"
        self.measured += list(keys)
        return {key: self.costs[key] for key in keys}


def test_stream_compiles_unified_programs_up_to_the_first_chunk_past_the_bound():
    """Waves from the smallest unified chunk: a decode bucket stops at its first chunk past the bound, so that
    the larger unified programs, which the budget never picks, are never built."""
    buckets = Buckets(decode=(1, 4), prefill_rows=(1,), chunk=(16, 32, 64, 128, 256, 512))
    assert buckets.unified_chunk == (64, 128, 256, 512)
    costs = {(1, 0, 0): 1.0, (4, 0, 0): 1.0, (1, 1, 64): 2.0, (1, 1, 128): 4.0, (4, 1, 64): 2.5,
             (4, 1, 128): 2.9, (4, 1, 256): 3.5}  # fmt: skip
    runner = CostedRunner(buckets, costs)
    budget = compile_overlapped(runner, bound=3.0)
    unified = {key for key in runner.compiled if key[0] and key[1]}
    assert unified == {(1, 1, 64), (1, 1, 128), (4, 1, 64), (4, 1, 128), (4, 1, 256)}
    assert {key for key in runner.compiled if not (key[0] and key[1])} == {(1, 0, 0), (4, 0, 0)} | {
        (0, 1, t) for t in buckets.chunk
    }
    assert budget.limits == ((1, 64), (4, 128))


def test_stream_on_the_cpu_runs_the_off_programs_with_a_measured_budget(stream_build, off_engine):
    """build_engine measures a compiled stream engine and sizes an overlap budget per decode bucket; on the CPU
    the stream runner compiles no concurrent command buffers, so its programs are off's."""
    engine = stream_build.engine
    assert stream_build.measured is not None and [rows for rows, _ in stream_build.measured.limits] == [1, 2, 4]
    assert all(tokens in (16, 32, 64) for _, tokens in stream_build.measured.limits)  # a chunk bucket each
    assert off_engine.scheduler.overlap_budget is None
    assert not engine.runner.overlaps and not overlaps_sides("stream", "cpu")
    assert overlaps_sides("stream", "gpu") and not overlaps_sides("off", "gpu")
    assert set(engine.runner.executables) == set(off_engine.runner.executables)


# ---- same plans, same bits; own plans, same greedy tokens ---------------------------------------------


def test_stream_plans_replayed_through_off_give_the_same_bits(stream_engine, off_engine, monkeypatch):
    """32 mixed requests (greedy and seeded sampling, logprobs) on the stream engine; every step it launched is
    then launched again, plan and sampling rows as they were, through the off engine's runner. Same programs and
    inputs: every step output, and each request's delivered tokens and logprobs, must agree bit for bit."""
    requests = mixed_requests(32, seed=1, sampled_every=4)
    recorder = LaunchRecorder(stream_engine.runner, monkeypatch)
    collector = Collector()
    ids = [stream_engine.submit(p, params, collector) for p, params in requests]
    run_to_idle(stream_engine, limit=2000)
    results = [collector.result(rid, len(p)) for rid, (p, _) in zip(ids, requests, strict=True)]

    plans = recorder.plans
    actions = collections.Counter(plan.action for plan in plans)
    assert actions["overlap_launch"] >= 10 and actions["overlap_decode"] >= 1 and "unified" not in actions
    # Prompts cut into several chunks that each ran beside decode rows, capped at the budget.
    beside = collections.Counter(c.request_id for plan in plans if plan.decode for c in plan.prefill)
    assert sum(count >= 2 for count in beside.values()) >= 5
    assert max(chunks_beside_decoders(plans)) == CHUNK_BESIDE_DECODE
    assert max(plan.num_prefill_tokens for plan in plans if not plan.decode) == 64  # the cap without decoders

    logprobs = {rid: params.logprobs for rid, (_, params) in zip(ids, requests, strict=True)}
    delivered = replay(off_engine.runner, recorder.steps, logprobs)
    for rid, result, (_, params) in zip(ids, results, requests, strict=True):
        assert result.finish_reason == "length" and len(result.token_ids) == params.max_tokens
        assert result.logprobs == delivered[rid], rid
    # The seeded requests sampled: at temperature 0.8 over ~flat distributions the draw is rarely the argmax.
    sampled_results = [r for r, (_, params) in zip(results, requests, strict=True) if params.sampling.temperature]
    assert len(sampled_results) == 8
    assert all(any(lp.token_id != lp.top[0][0] for lp in r.logprobs) for r in sampled_results)


def test_each_mode_under_its_own_plans_gives_the_same_greedy_tokens(stream_engine, off_engine, monkeypatch):
    requests = mixed_requests(32, seed=2)
    off_spy, stream_spy = StepSpy(off_engine.runner, monkeypatch), StepSpy(stream_engine.runner, monkeypatch)
    off_results, stream_results = generate(off_engine, requests), generate(stream_engine, requests)
    # Not vacuous: off put chunks of up to 64 tokens beside decode rows, stream at most the budget's 16.
    assert max(chunks_beside_decoders(off_spy.plans)) > CHUNK_BESIDE_DECODE
    assert max(chunks_beside_decoders(stream_spy.plans)) == CHUNK_BESIDE_DECODE
    for got, want in zip(stream_results, off_results, strict=True):
        assert got.finish_reason == want.finish_reason == "length"
        assert_same_greedy(got, want)


def run_decoders(engine, decoders: list, long_request=None) -> list:
    """Starts `decoders` and steps until all of them decode, then adds `long_request` (if any) and runs to the
    end; returns the decoders' results."""
    collector = Collector()
    ids = [engine.submit(p, params, collector) for p, params in decoders]
    step_until(engine, lambda: all(is_decoding(engine, rid) for rid in ids))
    if long_request is not None:
        engine.submit(*long_request, collector)
    run_to_idle(engine)
    return [collector.result(rid) for rid in ids]


def test_decoders_beside_a_long_prompt_match_decoders_alone(stream_engine, monkeypatch):
    decoders = [(prompt(8 + i, seed=300 + i), greedy(24)) for i in range(3)]
    alone = run_decoders(stream_engine, decoders)
    spy = StepSpy(stream_engine.runner, monkeypatch)
    beside = run_decoders(stream_engine, decoders, long_request=(prompt(130, seed=310), greedy(4)))
    # The 130-token prompt went in 16-token chunks, each in an overlapped step beside all three decoders.
    overlapped = [plan for plan in spy.plans if plan.action == "overlap_launch" and len(plan.decode) == 3]
    assert sum(plan.num_prefill_tokens for plan in overlapped) == 130 and len(overlapped) == 9
    for got, want in zip(beside, alone, strict=True):
        assert got.finish_reason == "length" and len(got.token_ids) == 24
        assert_same_greedy(got, want)


# ---- cancel, shutdown and errors while an overlapped step is in flight --------------------------------


def test_cancelling_the_last_decoder_mid_overlap_still_completes_the_prompt(
    stream_engine, off_engine, monkeypatch, caplog
):
    """The decoder is aborted while an overlapped step (its row + the prompt's second chunk) is in flight. The
    next step has no decoder: the engine processes the in-flight step first, then prefills at the full cap; the
    prompt completes with off's tokens, and the decoder gets nothing of the step in flight."""
    long_request = (prompt(130, seed=320), greedy(6))
    want = generate(off_engine, [long_request])[0]
    spy = StepSpy(stream_engine.runner, monkeypatch)
    collector = Collector()
    decoder = stream_engine.submit(prompt(7, seed=321), greedy(100), collector)
    step_until(stream_engine, lambda: is_decoding(stream_engine, decoder))
    long_id = stream_engine.submit(*long_request, collector)
    step_until(stream_engine, lambda: computed_tokens(stream_engine, long_id) == 32)
    in_flight = spy.plans[-1]  # step() returns with the step it launched still in flight
    assert in_flight.action == "overlap_launch" and [r.request_id for r in in_flight.decode] == [decoder]
    delivered = collector.tokens(decoder)
    stream_engine.abort(decoder)
    monkeypatch.setattr(stream_engine, "trace_steps", True)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        stream_engine.step()
    after = spy.plans[-1]
    assert after.action == "prefill" and not after.decode
    assert [(c.request_id, c.start, len(c.token_ids)) for c in after.prefill] == [(long_id, 32, 64)]
    waited = [(in_flight.step_id, "overlap_wait"), (in_flight.step_id, "overlap_complete"), (after.step_id, "prefill")]
    assert trace_actions(caplog) == waited
    run_to_idle(stream_engine)
    cancelled = collector.result(decoder)
    assert cancelled.finish_reason == "abort" and cancelled.token_ids == delivered
    result = collector.result(long_id, 130)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    assert_same_greedy(result, want)


def test_shutdown_with_a_prefill_in_flight_ends_every_request(engines, tiny_model, monkeypatch):
    """The loop thread launches the long prompt's first overlapped chunk beside three decoders, with a fifth
    request queued; shutdown comes while that step is in flight. The loop must drain it and end, and every
    request must get a finish, with every slot and page back. An engine of its own: shutdown is final. Its
    programs load from the compile cache as they are first used."""
    engine = engines.build(tiny_model, compile_now=False, decode_overlap="stream", **LIMITS)
    assert engine.scheduler.overlap_budget is None  # only a compiled engine is measured
    engine.scheduler.overlap_budget = BUDGET
    collector, launched, go = Collector(), threading.Event(), threading.Event()
    launch = engine.runner.launch
    long_ids: list[str] = []

    def launch_then_hold(plan, sampling):
        handle = launch(plan, sampling)
        if any(c.request_id in long_ids for c in plan.prefill) and not launched.is_set():
            launched.set()
            assert go.wait(HANG_GUARD_S)  # hold the loop until shutdown has been asked for
        return handle

    monkeypatch.setattr(engine.runner, "launch", launch_then_hold)
    stopper = threading.Thread(target=engine.shutdown, name="stopper")
    try:
        decoders = [engine.submit(prompt(6 + i, seed=330 + i), greedy(300), collector) for i in range(3)]
        long_ids.append(engine.submit(prompt(300, seed=333), greedy(4), collector))
        queued = engine.submit(prompt(10, seed=334), greedy(4), collector)
        engine.start()
        assert launched.wait(HANG_GUARD_S)
        stopper.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not engine._stopping:  # the loop reads this flag right after the step it is holding
            assert time.monotonic() < deadline, "shutdown did not raise the stop flag"
            time.sleep(0.001)
        go.set()
        stopper.join(HANG_GUARD_S)
        assert not stopper.is_alive() and not engine.is_running(), "the loop thread did not end"
        for rid in [*decoders, *long_ids, queued]:
            result = collector.result(rid)
            assert result.finish_reason == "abort" and result.error == "engine shut down", rid
        assert collector.tokens(long_ids[0]) == [] and collector.tokens(queued) == []
        assert all(collector.tokens(rid) for rid in decoders)
        assert_idle_and_free(engine)
    finally:
        go.set()
        if stopper.is_alive():
            stopper.join(HANG_GUARD_S)
        engine.shutdown()
        engines.release(engine)


@pytest.mark.parametrize("where", ["launch", "fetch", "fetch_at_wait"])
def test_an_overlapped_step_error_fails_only_its_requests(stream_engine, monkeypatch, caplog, where):
    """A decoder D runs; a long prompt P and a 40-token prompt Q arrive (Q admitted, waiting behind P). One
    overlapped step fails: its launch or its read-back (`fetch`; with `fetch_at_wait` the step is the one the
    engine waits on when D retires, D having sampled its last token in it). D and P, that step's requests, fail
    with the message; Q, admitted but in no failed step, and a later request are served bit for bit as alone.
    Exactly one error is logged: nothing but the failed step may fail."""
    p_queued, p_later = prompt(40, seed=340), prompt(12, seed=341)
    want_queued = generate(stream_engine, [(p_queued, greedy(5))])[0]
    want_later = generate(stream_engine, [(p_later, greedy(5))])[0]
    engine, failures, targets = stream_engine, [], []

    def fail(message: str):
        failures.append(message)
        raise RuntimeError(message)

    def is_target(plan) -> bool:
        if plan.action != "overlap_launch" or targets:
            return False
        return where != "fetch_at_wait" or engine.scheduler.running[decoder].remaining_tokens == 0

    launch, fetch = engine.runner.launch, StepHandle.fetch

    def failing_launch(plan, sampling):
        if is_target(plan):
            targets.append(plan)
            if where == "launch":
                fail(f"injected launch failure at step {plan.step_id}")
        return launch(plan, sampling)

    def failing_fetch(handle):
        if targets and handle.plan is targets[0] and not failures:
            fail(f"injected fetch failure at step {handle.plan.step_id}")
        return fetch(handle)

    monkeypatch.setattr(engine.runner, "launch", failing_launch)
    monkeypatch.setattr(StepHandle, "fetch", failing_fetch)
    spy = StepSpy(engine.runner, monkeypatch)
    monkeypatch.setattr(engine, "trace_steps", True)
    collector = Collector()
    decoder = engine.submit(prompt(6, seed=342), greedy(3 if where == "fetch_at_wait" else 40), collector)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        step_until(engine, lambda: is_decoding(engine, decoder))
        long_id = engine.submit(prompt(130, seed=343), greedy(5), collector)
        queued = engine.submit(p_queued, greedy(5), collector)
        run_to_idle(engine)
    assert len(failures) == 1 and len(targets) == 1
    target = targets[0]
    assert {r.request_id for r in target.decode} == {decoder} and [c.request_id for c in target.prefill] == [long_id]
    waited = (target.step_id, "overlap_wait") in trace_actions(caplog)
    assert waited == (where == "fetch_at_wait")
    errors = engine_errors(caplog)
    assert len(errors) == 1 and failures[0] in str(errors[0].exc_info[1]), [e.getMessage() for e in errors]
    for rid in (decoder, long_id):
        result = collector.result(rid)
        assert result.finish_reason == "error" and failures[0] in result.error, rid
    assert collector.tokens(long_id) == []
    # No chunk of P is launched once P has failed. A failed read-back is seen one step late (the next step is
    # launched first), except at the wait, which reads the step before launching the next.
    first_after = target.step_id + (2 if where == "fetch" else 1)
    assert not [plan.step_id for plan in spy.plans if plan.step_id >= first_after
                and any(c.request_id == long_id for c in plan.prefill)]  # fmt: skip
    got_queued = collector.result(queued)
    assert got_queued.token_ids == want_queued.token_ids and got_queued.logprobs == want_queued.logprobs
    later = generate(engine, [(p_later, greedy(5))])[0]
    assert later.token_ids == want_later.token_ids and later.logprobs == want_later.logprobs


# ---- the step trace -----------------------------------------------------------------------------------

# (decoder's (prompt, max_tokens), prompt's (prompt, max_tokens), expected (step offset, action) lines). The
# decoder is prefilled alone in step 0 (one chunk a step, FIFO); the prompt's 16-token chunks then run beside it.
TRACE_SCRIPTS = {
    # D samples its 2nd and 3rd (last) tokens in steps 1 and 2, beside P[0:16] and P[16:32]. Step 3 has no
    # decoder: the engine waits on step 2 (overlap_wait, then step 2 is complete) before launching P[32:40],
    # which samples P's first token; step 4 decodes P's second.
    "wait": ((5, 3), (40, 2), [(0, "prefill"), (1, "overlap_launch"), (2, "overlap_launch"), (1, "overlap_complete"),
                               (2, "overlap_wait"), (2, "overlap_complete"), (3, "prefill"), (4, "decode")]),
    # P (20 tokens, 1 output token) is done in steps 1 and 2 beside D; step 3 decodes D alone while step 2 is in
    # flight (overlap_decode); D's last token is sampled there, so step 4 is idle and not traced.
    "decode_behind": ((5, 4), (20, 1), [(0, "prefill"), (1, "overlap_launch"), (2, "overlap_launch"),
                                        (1, "overlap_complete"), (3, "overlap_decode"), (2, "overlap_complete")]),
}  # fmt: skip


def test_a_prefix_copy_from_a_chunk_dropped_after_a_failed_step_fails_its_sample(stream_engine):
    """Two samples of one prompt: the first one's chunk that ends at the prefix, with the second one's copy, is in
    the next plan when the wait on a failed overlapped step retires the first one. The plan then drops the chunk,
    and the copy, whose source would be the freed caches; the second sample, which counted the prefix as fed,
    fails with a message instead of decoding from them."""
    engine, collector, p = stream_engine, Collector(), prompt(12, seed=5)
    first = engine.submit(p, greedy(2), collector)
    second = engine.submit(p, greedy(2), collector, fork_of=first)
    engine._drain_inbox()
    plan = engine.scheduler.schedule()
    assert [(c.request_id, c.end) for c in plan.prefill] == [(first, 11)] and len(plan.copies) == 1
    engine._finish(first, "error", emit=True, error="the step failed")  # what processing the failed step does
    kept = engine._without_retired(plan)
    assert kept.prefill == () and kept.copies == () and kept.action == "idle"
    assert collector.result(second, len(p)).finish_reason == "error"
    assert "shared failed" in collector.result(second, len(p)).error
    engine.run_until_done()


@pytest.mark.parametrize("script", sorted(TRACE_SCRIPTS))
def test_the_overlap_trace_follows_the_script(stream_engine, caplog, monkeypatch, script):
    (decoder_len, decoder_tokens), (prompt_len, prompt_tokens), expected = TRACE_SCRIPTS[script]
    monkeypatch.setattr(stream_engine, "trace_steps", True)
    requests = [
        (prompt(decoder_len, seed=350), greedy(decoder_tokens)),
        (prompt(prompt_len, seed=351), greedy(prompt_tokens)),
    ]
    collector = Collector()
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        ids = [stream_engine.submit(p, params, collector) for p, params in requests]
        run_to_idle(stream_engine, limit=20)
    lines = trace_actions(caplog)
    first = lines[0][0]
    assert [(step - first, action) for step, action in lines] == expected
    assert [len(collector.result(rid).token_ids) for rid in ids] == [decoder_tokens, prompt_tokens]


def test_auto_under_stream_keeps_prefilling_beside_a_finishing_decoder(stream_engine, off_engine, monkeypatch):
    """D has 3 tokens left after its prefill, inside `auto`'s finishing window (4): off/auto runs decode-only
    steps until D is done, then the prompt; stream/auto puts the prompt's chunks beside D at once."""
    requests = [(prompt(5, seed=360), greedy(4)), (prompt(40, seed=361), greedy(3))]
    plans, results = {}, {}
    for name, engine in (("off", off_engine), ("stream", stream_engine)):
        monkeypatch.setattr(engine.scheduler, "config", dataclasses.replace(engine.scheduler.config, policy="auto"))
        spy = StepSpy(engine.runner, monkeypatch)
        results[name] = generate(engine, requests)
        plans[name] = spy.plans
    assert [p.action for p in plans["off"]] == ["prefill", "decode", "decode", "decode", "prefill", "decode", "decode"]
    assert [p.budget for p in plans["off"][1:4]] == [0, 0, 0]
    assert [p.action for p in plans["stream"]] == ["prefill", *["overlap_launch"] * 3, "overlap_decode", "decode"]
    assert [p.num_prefill_tokens for p in plans["stream"][1:4]] == [16, 16, 8]
    for got, want in zip(results["stream"], results["off"], strict=True):
        assert_same_greedy(got, want)


# ---- flags ------------------------------------------------------------------------------------------


def test_only_the_unified_programs_of_an_overlapping_runner_get_a_concurrent_command_buffer():
    """The programs with both sides, and only those, are compiled concurrent under `stream` on a GPU; `off` and
    the one-sided programs keep XLA's serialised command buffer, so the A/B of the two modes differs only there."""
    overlapping, serial = types.SimpleNamespace(overlaps=True), types.SimpleNamespace(overlaps=False)
    for key in [(16, 1, 256), (1, 1, 64)]:
        assert CONCURRENT_GRAPH.items() <= (Runner.compiler_options(overlapping, "step", key) or {}).items()
        assert not CONCURRENT_GRAPH.keys() & (Runner.compiler_options(serial, "step", key) or {}).keys()
    for key in [(16, 0, 0), (0, 1, 256), (0, 4, 128)]:
        assert not CONCURRENT_GRAPH.keys() & (Runner.compiler_options(overlapping, "step", key) or {}).keys()
    assert Runner.compiler_options(overlapping, "row", ("sample", 17)) is None
    assert not CONCURRENT_GRAPH.keys() & PINNED_GEMMS.keys()


def test_on_a_gpu_prefill_only_programs_run_without_command_buffers(monkeypatch):
    """Prefill-only step programs launch kernel by kernel on a GPU (PREFILL_WITHOUT_GRAPHS); every program with
    decode rows keeps its command buffer, and row programs and CPU compiles take none of it."""
    runner = types.SimpleNamespace(overlaps=False)
    assert not (Runner.compiler_options(runner, "step", (0, 1, 1024)) or {})  # this CPU
    monkeypatch.setattr(runner_module.jax, "default_backend", lambda: "gpu")
    for key in [(0, 1, 1024), (0, 4, 128)]:
        assert PREFILL_WITHOUT_GRAPHS.items() <= Runner.compiler_options(runner, "step", key).items()
    for key in [(1, 0, 0), (64, 0, 0), (16, 1, 256), (1, 1, 64)]:
        assert not PREFILL_WITHOUT_GRAPHS.keys() & (Runner.compiler_options(runner, "step", key) or {}).keys()
    assert Runner.compiler_options(runner, "row", ("sample", 17)) is None


def test_on_a_gpu_every_step_program_skips_rematerialization(monkeypatch):
    """Every step program compiles without XLA's rematerialization pass on a GPU, whatever its sides; row programs
    and CPU compiles keep XLA's defaults. XLA knows the option by that name: a compile with it succeeds here, where an
    unknown option name is refused."""
    runner = types.SimpleNamespace(overlaps=True)
    assert not (Runner.compiler_options(runner, "step", (1, 0, 0)) or {})  # this CPU
    monkeypatch.setattr(runner_module.jax, "default_backend", lambda: "gpu")
    for key in [(1, 0, 0), (64, 0, 0), (0, 1, 1024), (0, 4, 128), (16, 1, 256), (1, 1, 64), (64, 8, 128)]:
        assert NO_REMATERIALIZATION.items() <= Runner.compiler_options(runner, "step", key).items()
    assert Runner.compiler_options(runner, "row", ("sample", 17)) is None
    monkeypatch.undo()
    program = jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.ones((4, 4)))
    assert program.compile(compiler_options=NO_REMATERIALIZATION)(jnp.eye(4))[0, 0] == pytest.approx(np.tanh(1.0))
    with pytest.raises(Exception, match="xla_no_such_pass_option"):
        program.compile(compiler_options={"xla_no_such_pass_option": "x"})


@pytest.mark.parametrize("bound", [0.5, 0.999, "3", True])
def test_overlap_step_bound_below_one_is_refused(bound):
    with pytest.raises(ValueError, match="--overlap-step-bound"):
        EngineConfig(overlap_step_bound=bound)
    assert EngineConfig(overlap_step_bound=1.0).overlap_step_bound == 1.0
