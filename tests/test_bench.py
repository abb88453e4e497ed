"""The benchmark client against the live tiny server: a short run finishes with zero failures and a complete
JSON result; a Poisson run; the A/B table; flag checks; and the percentile arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest_plugins = ["_server"]

SHORT = ["--input-len", "16", "--output-len", "8", "--num-prompts", "8", "--quiet"]


def bench_flags(server) -> list[str]:
    return ["--base-url", server.root, "--api-key", server.api_key, "--token-id-max", str(server.vocab_size)]


def test_short_run_at_fixed_concurrency_has_no_failures(idle_server, tmp_path):
    result = tmp_path / "a.json"
    command = [sys.executable, "-m", "qwen35_jax.serving.bench", *bench_flags(idle_server), *SHORT,
               "--max-concurrency", "4", "--label", "conc4", "--result-json", str(result), "--save-detailed"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads(result.read_text())
    assert summary["failed"] == 0 and summary["completed"] == 8, summary["errors"]
    assert summary["model"] == idle_server.model_name  # found through /v1/models
    assert summary["total_input_tokens"] == 8 * 16 and summary["total_output_tokens"] == 8 * 8
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert summary[f"{stat}_{name}_ms"] > 0
    assert summary["p50_ttft_ms"] <= summary["p99_ttft_ms"] <= summary["p99_e2el_ms"]
    assert summary["request_throughput"] > 0 and summary["output_throughput"] > 0
    assert summary["total_token_throughput"] > summary["output_throughput"]
    assert "TTFT mean (ms)" in run.stdout
    # --save-detailed: each request's TTFT and its gaps between the 8 tokens' chunks
    assert len(summary["ttfts"]) == 8 and [len(gaps) for gaps in summary["itls"]] == [7] * 8
    assert max(summary["ttfts"]) * 1000 <= summary["p99_e2el_ms"]


def test_poisson_run_through_the_cli_and_the_ab_table(idle_server, tmp_path, capsys):
    from qwen35_jax.cli import main

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, rate in ((a, "inf"), (b, "40")):
        code = main(["bench", *bench_flags(idle_server), *SHORT, "--model", idle_server.model_name,
                     "--request-rate", rate, "--result-json", str(path)])  # fmt: skip
        assert code == 0
        assert json.loads(path.read_text())["failed"] == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(a), str(b)]) == 0
    table = capsys.readouterr().out
    assert "TTFT p99 (ms)" in table and "output tok/s" in table and "B vs A" in table
    assert "note: request_rate differs" in table


def test_failures_are_counted_not_fatal(idle_server, tmp_path):
    from qwen35_jax.serving import bench

    result = tmp_path / "bad.json"
    code = bench.main([*bench_flags(idle_server), *SHORT, "--model", "no-such-model", "--result-json", str(result)])
    assert code == 0
    summary = json.loads(result.read_text())
    assert summary["failed"] == 8 and summary["completed"] == 0
    assert any("404" in error for error in summary["errors"])


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--input-len", "0"], "--input-len"), (["--max-concurrency", "0"], "--max-concurrency"),
     (["--request-rate", "0"], "--request-rate"), (["--token-id-min", "600", "--token-id-max", "512"], "--token-id")],
)  # fmt: skip
def test_bad_bench_flags_exit_2(flags, named, capsys):
    from qwen35_jax.serving import bench

    assert bench.main(flags) == 2
    assert named in capsys.readouterr().err


def test_percentiles_interpolate_like_numpy():
    from qwen35_jax.serving.bench import _percentile

    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert _percentile(values, 50) == 3.0
    assert _percentile(values, 90) == pytest.approx(7.6)
    assert _percentile(values, 99) == pytest.approx(9.76)
    assert _percentile([5.0], 99) == 5.0


def test_largest_batch_stops_at_the_first_out_of_memory():
    from qwen35_jax.serving.offline_bench import largest_batch

    tried = []

    def try_batch(batch):
        tried.append(batch)
        if batch >= 512:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 31.2GiB")
        return {"batch": batch}

    best, failure = largest_batch([768, 256, 512, 384], try_batch)
    assert tried == [256, 384, 512] and best == {"batch": 384}
    assert failure["batch"] == 512 and "RESOURCE_EXHAUSTED" in failure["error"]
    assert largest_batch([1, 2], lambda b: {"batch": b}) == ({"batch": 2}, None)


def test_largest_batch_does_not_hide_other_errors():
    import pytest

    from qwen35_jax.serving.offline_bench import largest_batch

    def try_batch(batch):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        largest_batch([1, 2], try_batch)


def test_a_batch_the_kv_pool_cannot_hold_is_refused_before_it_runs(tiny_model):
    """The largest-batch search must stop at a batch whose reservations exceed the KV pool (it would never
    decode in full, and its steady steps would not exist), and count it as "does not fit", not as a bug."""
    import pytest

    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.serving.offline_bench import BatchDoesNotFit, check_batch_fits, largest_batch

    engine = build_engine(tiny_model, EngineConfig(max_batch=4, max_prefill_tokens=16, max_model_len=64,
                                                   num_pages=17, page_size=16, compile_cache=None), compile_now=False)  # fmt: skip
    check_batch_fits(engine, 4, 64)  # 4 rows x 4 pages = the 16 allocatable pages
    with pytest.raises(BatchDoesNotFit, match="does not fit"):
        check_batch_fits(engine, 4, 65)  # 5 pages a row
    with pytest.raises(BatchDoesNotFit, match="GDN slots"):
        check_batch_fits(engine, 5, 16)  # 4 slots

    def try_batch(batch):
        check_batch_fits(engine, batch, 64)
        return {"batch": batch}

    best, failure = largest_batch([2, 4, 8], try_batch)
    assert best == {"batch": 4} and failure["batch"] == 8 and "does not fit" in failure["error"]


def test_offline_bench_decode_only_on_a_device_without_limits(tmp_path):
    """The offline benchmark end to end on the tiny model: `--prefill ''` times decode alone (the `lease_bench.sh
    host` stage's form), and on a device with no measured limits (this CPU) the floor columns are null rather than
    another card's."""
    from qwen35_jax.serving import offline_bench

    result = tmp_path / "engine.json"
    offline_bench.main(["--model", "tiny", "--context", "32", "--batches", "1", "--prefill", "", "--steps", "4",
                        "--result-json", str(result)])  # fmt: skip
    data = json.loads(result.read_text())
    assert "prefill" not in data and data["limits"] is None
    (decode,) = data["decode"]
    assert decode["batch"] == 1 and decode["steps_measured"] == 4 and decode["tpot_ms"] > 0
    assert decode["floor_ms"] is None and decode["roofline_fraction"] is None
    # Each figure is a median over the steps; a step's own time without the copies' wait is at most the same
    # step's with it, so the medians keep that order.
    assert 0 < decode["host_own_ms"] <= decode["host_own_with_transfer_ms"]
