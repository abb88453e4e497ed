"""The program store (serving/program_store.py): a warm start loads every compiled program without tracing or
lowering it, the loaded programs compute what the compiled ones did, and anything that would change a program
(its engine's config, the sources) makes a store of its own."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import generate, greedy, prompt, sampled

from qwen35_jax.serving import program_store
from qwen35_jax.serving.factory import EngineConfig, build_engine
from qwen35_jax.serving.program_store import KEEP_FINGERPRINTS, ProgramStore
from qwen35_jax.serving.runner import Runner

LIMITS = dict(max_batch=2, max_prefill_tokens=32, max_model_len=128)
# A page-table width no other test uses, so XLA's cache (one per process, whatever the folder) holds none of these
# programs and XLA compiles them all.
UNSEEN = {**LIMITS, "max_model_len": 144}


def requests():
    return [(prompt(40, seed=1), greedy(6)), (prompt(9, seed=2), sampled(6, seed=3)), (prompt(20, seed=4), greedy(5))]


def program_count(runner) -> int:
    return runner.num_compiles + runner.num_row_compiles + runner.num_prompt_compiles


def test_a_warm_start_loads_every_program_without_lowering_and_gives_the_same_outputs(
    tiny_model, tmp_path, monkeypatch
):
    cache = str(tmp_path / "cache")
    cold = build_engine(tiny_model, EngineConfig(compile_cache=cache, program_store=True, **UNSEEN))
    # Every step program is XLA's own compile here; row programs of other tests' shapes may come from its cache.
    assert cold.runner.store.loaded == 0 and cold.runner.store.saved >= cold.runner.num_compiles > 5
    expected = generate(cold, requests())

    def no_lowering(*args):
        raise AssertionError("a stored program was lowered again")

    monkeypatch.setattr(Runner, "_lower", no_lowering)
    warm = build_engine(tiny_model, EngineConfig(compile_cache=cache, program_store=True, **UNSEEN))
    assert warm.runner.store.path == cold.runner.store.path
    assert warm.runner.store.loaded == cold.runner.store.saved and program_count(warm.runner) == program_count(
        cold.runner
    )
    assert set(warm.runner.compile_seconds) == set(warm.runner.buckets.keys()) and warm.runner.store.saved == 0
    for got, want in zip(generate(warm, requests()), expected, strict=True):
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_programs_served_by_xlas_cache_are_not_stored(tiny_model, tmp_path):
    """XLA:CPU cannot serialise a program it loaded from its cache (the copy fails when run): such programs are
    served by the cache again on the next start instead of being stored broken."""
    cache = str(tmp_path / "cache")
    limits = {**LIMITS, "prompt_logprobs_chunk": 0}  # the step and row programs show it; three builds of fewer
    first = build_engine(tiny_model, EngineConfig(compile_cache=cache, program_store=True, **limits))
    expected = generate(first, requests())
    for stored in first.runner.store.path.iterdir():
        stored.unlink()  # XLA's cache now holds every program, the store none
    served = build_engine(tiny_model, EngineConfig(compile_cache=cache, program_store=True, **limits))
    assert served.runner.store.saved < program_count(served.runner) // 2
    again = build_engine(tiny_model, EngineConfig(compile_cache=cache, program_store=True, **limits))
    assert again.runner.store.loaded == served.runner.store.saved
    for got, want in zip(generate(again, requests()), expected, strict=True):
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_what_changes_a_program_changes_the_store(tiny_model, tmp_path, monkeypatch):
    root = tmp_path / "programs"
    base = build_engine(
        tiny_model, EngineConfig(compile_cache=None, program_store=True, **LIMITS), compile_now=False
    ).runner
    path = ProgramStore(root, base.program_identity()).path
    assert ProgramStore(root, base.program_identity()).path == path  # stable across instances
    wider = build_engine(
        tiny_model, EngineConfig(compile_cache=None, program_store=True, **{**LIMITS, "max_batch": 4}), False
    ).runner
    assert ProgramStore(root, wider.program_identity()).path != path
    monkeypatch.setattr(program_store, "source_digest", lambda: "edited sources")
    assert ProgramStore(root, base.program_identity()).path != path
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    monkeypatch.setattr(program_store, "source_digest", program_store.source_digest)
    assert ProgramStore(root, base.program_identity()).path != path


@pytest.fixture
def double():
    return jax.jit(lambda x: (x * 2, x.sum()), donate_argnums=0)


def test_a_damaged_program_file_is_compiled_again(tmp_path, double):
    store = ProgramStore(tmp_path, "identity")
    x = jnp.arange(4.0)
    store.save("double", double.lower(x).compile())
    loaded = store.load("double")
    np.testing.assert_array_equal(loaded(jnp.arange(4.0))[0], [0, 2, 4, 6])
    (store.path / "double.bin").write_bytes(b"not a program")
    assert store.load("double") is None and store.loaded == 1
    assert store.load("missing") is None


def test_only_the_newest_stores_are_kept(tmp_path, double):
    for age in range(KEEP_FINGERPRINTS + 2):
        old = tmp_path / f"old{age}"
        old.mkdir()
        os.utime(old, (1000 + age, 1000 + age))
    store = ProgramStore(tmp_path, "identity")
    store.save("double", double.lower(jnp.arange(4.0)).compile())
    kept = sorted(p.name for p in tmp_path.iterdir())
    newest_old = [f"old{age}" for age in range(KEEP_FINGERPRINTS + 2)][-(KEEP_FINGERPRINTS - 1) :]
    assert kept == sorted([store.path.name, *newest_old])
