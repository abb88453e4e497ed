"""`--decode-overlap stream` on a GPU at 4B shapes (random bf16 weights): the unified program runs kernels on
several streams at once (its profiler trace spans less than its kernels' summed time; `off`'s does not), it is
faster than the same two sides as separate programs, one after the other, and with the same plans it gives the
same greedy tokens as `off` over 64 requests. Run with `JAX_PLATFORMS=cuda pytest -m gpu`; `tools/overlap_ab.py`
prints the same figures for more buckets."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

TOOL = Path(__file__).resolve().parents[1] / "tools" / "overlap_ab.py"
BATCH, CHUNK = 16, 256


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("overlap_ab", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    from qwen35_jax.api import load_model

    return load_model("4b", dtype="bfloat16", kernels="pallas")


@pytest.fixture(scope="module")
def runners(ab, model):
    built = {mode: ab.build_runner(model, mode, [BATCH], [CHUNK], max_model_len=2048, num_pages=2048)
             for mode in ("off", "stream")}  # fmt: skip
    for runner in built.values():
        runner.compile_all()
    return built


def test_the_unified_program_runs_kernels_on_several_streams_at_once(ab, runners):
    """The trace's span against the kernels' sum: a program whose kernels ran one after another spans at least
    their sum (gaps between them add to it); below it, some ran at once."""
    key = (BATCH, 1, CHUNK)
    stream, off = (ab.traced_streams(runners[mode], key) for mode in ("stream", "off"))
    assert stream["streams"] >= 2 and stream["span_ms"] < 0.97 * stream["kernel_sum_ms"], stream
    assert off["span_ms"] >= off["kernel_sum_ms"], off


def test_the_overlapped_program_beats_its_sides_in_sequence(runners):
    stream = runners["stream"]
    costs = stream.measure_step_costs(stream.buckets.keys(), repeats=5)
    sides = costs[(BATCH, 0, 0)] + costs[(0, 1, CHUNK)]
    assert costs[(BATCH, 1, CHUNK)] < sides, (costs, sides)


def test_stream_and_off_give_the_same_greedy_tokens(ab, runners):
    tokens = {mode: ab.greedy_tokens(runner, [BATCH], 64, seed=1) for mode, runner in runners.items()}
    assert tokens["stream"] == tokens["off"]
