"""Serving before the whole program set is built (`--background-compile`): the ready set covers every bucket, steps
pad up to built programs and compute what the exact buckets do, the background thread builds the rest, and the
flags that need the whole set first refuse it."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_engine import Collector, assert_same_greedy, generate, greedy, prompt, sampled

from qwen35_jax.serving.factory import EngineConfig, build_engine
from qwen35_jax.serving.metrics import ServingMetrics
from qwen35_jax.serving.runner import Buckets, Runner

LIMITS = dict(max_batch=4, max_prefill_tokens=256, max_model_len=512)  # packed programs (0, 2, 128), (0, 4, 64)


def covers(big, small) -> bool:
    return all((x > 0) == (y > 0) and x >= y for x, y in zip(big, small, strict=True))


@pytest.mark.parametrize("limits", [(16, 1024, 8), (4, 64, 8), (64, 2048, 4), (1, 16, 1), (8, 256, 2)])
def test_the_ready_set_covers_every_bucket(limits):
    buckets = Buckets.for_limits(*limits)
    ready = buckets.ready_keys()
    assert set(ready) <= set(buckets.keys())
    for key in buckets.keys():
        assert any(covers(r, key) for r in ready), key
    assert set(buckets.rows_of(ready)) <= set(buckets.row_programs())


def test_the_defaults_ready_set():
    buckets = Buckets.for_limits(16, 1024, 8)
    assert buckets.ready_keys() == [(16, 0, 0), (0, 1, 1024), (0, 2, 512), (0, 4, 256), (0, 8, 128), (16, 1, 1024),
                                    (16, 8, 128)]  # fmt: skip
    assert len(buckets.keys()) == 42


def workload():
    """Decoders beside chunked prompts, short prompts arriving together (packed steps), sampled rows, logprobs."""
    short = [(prompt(12 + i, seed=10 + i), greedy(6)) for i in range(5)]
    return short + [(prompt(300, seed=i), greedy(8) if i % 3 else sampled(8, seed=i)) for i in range(4)]


def launched_keys(runner, monkeypatch) -> list:
    keys, launch = [], runner.launch

    def spy(plan, sampling):
        handle = launch(plan, sampling)
        keys.append((handle.key, runner.buckets.key_for(plan)))
        return handle

    monkeypatch.setattr(runner, "launch", spy)
    return keys


def test_steps_pad_up_to_the_ready_set_and_match_the_exact_buckets(tiny_model, compile_cache_dir, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    # The reference run compiles each exact bucket as a step first needs it (compile_now=False), and no
    # prompt-logprobs programs (its workload asks for none): the whole set would be most of this test's time.
    full = build_engine(tiny_model, EngineConfig(compile_cache=compile_cache_dir, prompt_logprobs_chunk=0, **LIMITS),
                        compile_now=False)  # fmt: skip
    expected = generate(full, workload())
    monkeypatch.setattr(Runner, "compile_in_background", lambda self, workers=1: None)
    # An empty program store, so that only the ready set is built (a warm store would load every program).
    engine = build_engine(tiny_model, EngineConfig(compile_cache=str(tmp_path), background_compile=True, **LIMITS))
    runner = engine.runner
    monkeypatch.setattr(runner, "store", None)  # nothing more may be loaded or compiled while serving
    built = set(runner.executables)
    assert set(runner.buckets.ready_keys()) <= built < set(runner.buckets.keys())
    assert runner.buckets.prompt_logprobs_chunk and not runner.prompt_executables  # built in the background
    text = ServingMetrics("tiny", LIMITS["max_model_len"], engine).render().decode()
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert gauges["qwen35_jax_programs_built"] < gauges["qwen35_jax_programs_total"] == len(
        runner.buckets.keys()) + len(runner.buckets.row_programs()) + len(runner.buckets.prompt_logprobs_chunk)  # fmt: skip
    keys = launched_keys(runner, monkeypatch)
    results = generate(engine, workload())
    assert set(runner.executables) == built, "a step compiled a program while serving"
    padded = [(used, exact) for used, exact in keys if used != exact]
    assert padded and all(covers(used, exact) and used in built for used, exact in padded)
    assert {exact[1] for _, exact in keys} > {0, 1}, "the workload must pack prompts"
    for got, want, (_, params) in zip(results, expected, workload(), strict=True):
        if params.sampling.temperature == 0:
            assert_same_greedy(got, want)
        else:  # seeded draws over fp32 logits that differ in the last bits: same length, finished
            assert len(got.token_ids) == len(want.token_ids) and got.finish_reason == want.finish_reason


def test_shutdown_stops_the_background_build(tiny_model, compile_cache_dir):
    engine = build_engine(tiny_model, EngineConfig(compile_cache=compile_cache_dir, background_compile=True, **LIMITS))
    engine.shutdown()
    assert not any(t.name == "background-compile" and t.is_alive() for t in threading.enumerate())


def test_a_stopped_build_builds_nothing_more(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(compile_cache=None, **LIMITS), compile_now=False)
    stop = threading.Event()
    stop.set()
    engine.runner.compile_all(stop=stop)
    assert engine.runner.num_compiles == 0 and engine.runner.num_row_compiles == 0


def test_prompt_logprobs_are_on_by_default_within_the_prefill_budget():
    """vLLM serves prompt logprobs without a flag: 64-token chunks by default, fewer when a step prefills fewer."""
    assert EngineConfig().prompt_logprobs_chunk == 64
    assert EngineConfig(max_prefill_tokens=32).prompt_logprobs_chunk == 32
    assert EngineConfig(prompt_logprobs_chunk=0).prompt_logprobs_chunk == 0
    with pytest.raises(ValueError, match="--prompt-logprobs-chunk"):
        EngineConfig(max_prefill_tokens=32, prompt_logprobs_chunk=64)


def test_the_flags_that_build_everything_first():
    assert EngineConfig(background_compile=None).background_compile is True
    assert EngineConfig(background_compile=None, deterministic=True).background_compile is False
    assert EngineConfig(background_compile=None, decode_overlap="stream").background_compile is False
    assert EngineConfig().background_compile is False  # the library builds everything unless asked
    for other in ({"deterministic": True}, {"decode_overlap": "stream"}):
        with pytest.raises(ValueError, match="--background-compile"):
            EngineConfig(background_compile=True, **other)


def test_the_background_thread_builds_the_rest_and_an_idle_engine_runs_each_once(tiny_model, compile_cache_dir,
                                                                                  monkeypatch):  # fmt: skip
    """The thread builds every other program, and then steps run their own buckets. On a GPU a program's first run
    is slow (its kernels load), so the engine thread runs each program built in the background once while it has
    nothing else to do (`Engine.warm_up_idle`, set on a GPU; forced here)."""
    engine = build_engine(tiny_model, EngineConfig(compile_cache=compile_cache_dir, background_compile=True, **LIMITS))
    runner = engine.runner
    engine.warm_up_idle = True
    engine.start()
    try:
        runner.wait_for_background(timeout=600)
        assert set(runner.executables) == set(runner.buckets.keys())
        assert set(runner.prompt_executables) == set(runner.buckets.prompt_logprobs_chunk)
        assert set(runner.row_executables) == set(runner.buckets.row_programs())
        deadline = time.monotonic() + 300
        while runner.unwarmed() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not runner.unwarmed()
        keys = launched_keys(runner, monkeypatch)
        collector = Collector()
        ids = [engine.submit(p, params, collector) for p, params in workload()]
        collector.wait(lambda: all(collector.is_finished(i) for i in ids))
        assert all(collector.result(i).finish_reason == "length" for i in ids)
        assert keys and all(used == exact for used, exact in keys)
    finally:
        engine.shutdown()


def test_warm_up_runs_each_program_twice(tiny_model):
    """XLA runs a program with command buffers op by op the first time and records its CUDA graph on the second:
    the warm-up makes both runs, so that neither falls in a request's first step."""
    from qwen35_jax.cache import CacheSpec
    from qwen35_jax.kernels import REF

    runner = Runner(tiny_model.model_def, tiny_model.params, REF, CacheSpec(8, 16, 2), Buckets((1,), (), ()), 64)
    key = (1, 0, 0)
    program = runner.compile(key)
    calls = []
    runner.executables[key] = lambda *args: calls.append(key) or program(*args)
    runner.warm_up()
    assert calls == [key, key]
    assert not runner.unwarmed()


class _Building:
    """A runner's background build, as `freeze_startup_heap` sees it: running until `finish` is set."""

    def __init__(self):
        self.finish = threading.Event()
        self._thread = threading.Thread(target=self.finish.wait, daemon=True)
        self._thread.start()

    @property
    def building(self) -> bool:
        return self._thread.is_alive()

    def wait_for_background(self, timeout=None) -> None:
        self._thread.join(timeout)


def test_the_start_up_heap_is_frozen_now_and_again_after_the_background_build():
    """The serve command's heap: what is alive at start-up leaves the collector's scans at once, and what the
    background build made leaves them when the build ends."""
    import gc

    from qwen35_jax.serving.factory import freeze_startup_heap

    gc.unfreeze()
    try:
        runner = _Building()
        waiter = freeze_startup_heap(runner)
        at_start = gc.get_freeze_count()
        assert at_start > 0 and waiter is not None
        built = [[i] for i in range(1000)]  # what the build makes meanwhile: tracked containers
        assert waiter.is_alive(), "the second freeze waits for the build"
        runner.finish.set()
        waiter.join(10)
        assert not waiter.is_alive() and gc.get_freeze_count() >= at_start + len(built)
        assert freeze_startup_heap(runner) is None  # nothing building: one freeze, no thread
    finally:
        gc.unfreeze()
