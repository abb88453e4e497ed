"""Offline engine benchmark (no HTTP): decode TPOT and throughput per batch at a given context, prefill
throughput per prompt length, compile times; each figure beside its roofline floor.

    python -m qwen35_jax.serving.offline_bench --model 4b --batches 1,16,64,256 --context 1024 \\
        --prefill 1024,8192 --result-json engine.json

Floors, from the card's measured limits (qwen35_jax/roofline.py; 4.3 TB/s and 790 TFLOP/s on the H200): decode
step >= bytes read per step / HBM bandwidth (every weight once, the KV of every row's context, the GDN state read
and written); prefill >= bf16 FLOPs / the bf16 matrix rate (2 x non-embedding params x tokens, plus causal
attention). On a device without measured limits (a CPU) the floor fields are null. Requests run through the real engine (scheduler, runner,
one-step-late reads), with random prompts and ignore_eos.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

from qwen35_jax.roofline import device_limits


def parameter_count(cfg) -> int:
    from qwen35_jax.weights import weight_specs

    return sum(int(np.prod(p.shape)) * len(p.hf_keys) for s in weight_specs(cfg, np.float32) for p in s.parts)


def decode_floor_bytes(cfg, batch: int, context: int, dtype_bytes: int = 2, state_bytes: int = 4) -> int:
    """state_bytes: of one recurrent state element, as the pool stores it (`--mamba-ssm-cache-dtype`)."""
    weights = parameter_count(cfg) * dtype_bytes
    kv = batch * context * cfg.num_full_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_bytes
    gdn = batch * cfg.num_linear_layers * state * 2  # read and write back
    return weights + kv + gdn


def prefill_floor_flops(cfg, tokens: int) -> float:
    dense = 2 * (parameter_count(cfg) - cfg.vocab_size * cfg.hidden_size) * tokens
    attention = 2 * 2 * (tokens * tokens / 2) * cfg.num_attention_heads * cfg.head_dim * cfg.num_full_layers
    return dense + attention + 2 * cfg.vocab_size * cfg.hidden_size  # lm_head for the last token


@dataclasses.dataclass
class StepClock:
    """Wall time of each engine.step() call with the plan it launched; in steady state one step() is
    launch(N) + wait(N-1), so its duration is the device time of one step, unless the host is slower.
    To tell which, each record also holds the host time of the launch (inputs built and the program
    dispatched), of processing the previous step (its fetch, which blocks until the device is done and its
    outputs are on the host, and the host work on its tokens), and of the two parts of that fetch spent
    waiting: for the device's step, then for the device-to-host copies of its outputs (on the H200 they start
    ~0.34 ms after the step's last kernel, by the profile of a batch-64 step). Launch plus processing less both
    waits is the host's own work a step. A step whose waits are ~0 was waited for by nobody, i.e. the host is
    the bottleneck."""

    records: list = dataclasses.field(default_factory=list)

    def run(self, engine, until) -> None:
        import jax

        launch, process = engine.runner.launch, engine._process
        spent = {}

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[name] = time.perf_counter() - start

            return wrapper

        def launch_with_timed_wait(*args, **kwargs):
            handle = timed("launch", launch)(*args, **kwargs)
            if handle is not None:  # its fetch first waits for the device, then for the copies, each timed apart
                wait = timed("wait", lambda: jax.block_until_ready([x for x in handle.outputs if x is not None]))
                transfer = timed("transfer", handle.fetch)
                handle.fetch = lambda: (wait(), transfer())[1]
            return handle

        engine.runner.launch, engine._process = launch_with_timed_wait, timed("process", process)
        try:
            while not until():
                plan_before = engine.scheduler._next_step_id
                spent.clear()
                start = time.perf_counter()
                engine.step()
                self.records.append((plan_before, engine._in_flight, time.perf_counter() - start,
                                     spent.get("launch", 0.0), spent.get("process", 0.0),
                                     spent.get("wait", 0.0), spent.get("transfer", 0.0)))  # fmt: skip
        finally:
            engine.runner.launch, engine._process = launch, process


def _random_prompt(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(0, min(vocab, 248044), n).tolist()


class BatchDoesNotFit(RuntimeError):
    """The KV pool cannot hold every row's reservation at once, so the batch would never run in full."""


def check_batch_fits(engine, batch: int, tokens_per_row: int) -> None:
    """Raises BatchDoesNotFit before anything runs when `batch` reservations of `tokens_per_row` tokens (prompt +
    max_tokens: what admission reserves) exceed the KV pool, or there are fewer GDN slots than rows."""
    from qwen35_jax.serving.pools import pages_needed

    scheduler = engine.scheduler
    pages = batch * pages_needed(tokens_per_row, scheduler.page_pool.page_size)
    if pages > scheduler.page_pool.num_total or batch > scheduler.slot_pool.num_total:
        raise BatchDoesNotFit(
            f"batch {batch} does not fit: {batch} x {tokens_per_row} reserved tokens need {pages} KV pages, the "
            f"pool has {scheduler.page_pool.num_total}; {scheduler.slot_pool.num_total} GDN slots"
        )


def bench_decode(engine, cfg, batch: int, context: int, steps: int, rng) -> dict:
    from qwen35_jax.serving.engine import GenerationParams

    done = []
    max_tokens = batch + steps + 8  # every row is still decoding when the last prompt is in
    check_batch_fits(engine, batch, context + max_tokens)
    for _ in range(batch):
        engine.submit(_random_prompt(rng, context, cfg.vocab_size), GenerationParams(max_tokens, ignore_eos=True),
                      lambda o: done.append(o) if o.finish_reason else None)  # fmt: skip
    clock = StepClock()
    clock.run(engine, lambda: len(done) == batch)
    failed = [o.error for o in done if o.finish_reason == "error"]
    if failed:  # the engine fails a step's requests instead of raising (an out-of-memory step among them)
        raise RuntimeError(f"{len(failed)} of {batch} requests failed: {failed[0]}")
    full = [times for _, handle, *times in clock.records
            if handle is not None and handle.plan.action == "decode" and len(handle.plan.decode) == batch]  # fmt: skip
    measured = full[2 : 2 + steps]  # skip the first full steps: the previous step may still be a prefill
    steady = [seconds for seconds, *_ in measured]
    tpot = statistics.median(steady)
    limits = device_limits()
    floor_bytes = decode_floor_bytes(cfg, batch, context, state_bytes=engine.runner.cache.ssm.dtype.itemsize)
    return {
        "batch": batch, "context": context, "steps_measured": len(steady), "tpot_ms": tpot * 1e3,
        "tpot_p90_ms": float(np.percentile(steady, 90)) * 1e3, "throughput_tok_s": batch / tpot,
        **_against_floor(tpot, floor_bytes / limits.hbm_bytes_per_s if limits else None),
        "host_launch_ms": statistics.median(m[1] for m in measured) * 1e3,
        "host_fetch_and_process_ms": statistics.median(m[2] for m in measured) * 1e3,
        "host_device_wait_ms": statistics.median(m[3] for m in measured) * 1e3,
        # The fetch's wait for the copies of the step's outputs (np.asarray's own copy of a few bytes included).
        "host_transfer_wait_ms": statistics.median(m[4] for m in measured) * 1e3,
        # The host's own work a step: launch and processing, the waits for the device and its copies excluded.
        "host_own_ms": statistics.median(m[1] + m[2] - m[3] - m[4] for m in measured) * 1e3,
        "host_share_of_step": statistics.median(m[1] + m[2] - m[3] - m[4] for m in measured) / tpot,
        # What host_own was before the copies' wait was split out of it.
        "host_own_with_transfer_ms": statistics.median(m[1] + m[2] - m[3] for m in measured) * 1e3,
    }  # fmt: skip


def bench_prefill(engine, cfg, tokens: int, repeats: int, rng) -> dict:
    from qwen35_jax.serving.engine import GenerationParams

    times, first = [], []

    def on_output(output):
        if output.token_ids:
            first.append(time.perf_counter())

    for _ in range(repeats):
        start = time.perf_counter()
        engine.submit(_random_prompt(rng, tokens, cfg.vocab_size), GenerationParams(1, ignore_eos=True), on_output)
        engine.run_until_done()
        times.append(first[-1] - start)
    best = min(times)
    limits = device_limits()
    return {
        "tokens": tokens, "ttft_ms_best": best * 1e3, "ttft_ms_median": statistics.median(times) * 1e3,
        "throughput_tok_s": tokens / best,
        **_against_floor(best, prefill_floor_flops(cfg, tokens) / limits.bf16_flops_per_s if limits else None),
    }  # fmt: skip


def _against_floor(seconds: float, floor: float | None) -> dict:
    if floor is None:
        return {"floor_ms": None, "ratio_to_floor": None, "roofline_fraction": None}
    return {"floor_ms": floor * 1e3, "ratio_to_floor": seconds / floor, "roofline_fraction": floor / seconds}


def build(args, model, batches: list[int], chunks: list[int], max_model_len: int):
    """An engine whose bucket set is exactly what this measurement needs (and the unified steps between)."""
    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.serving.runner import Buckets

    config = EngineConfig(
        max_batch=batches[-1], max_prefill_tokens=chunks[-1], max_model_len=max_model_len,
        gpu_memory_fraction=args.gpu_memory_fraction, compile_cache=args.compile_cache,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
    )  # fmt: skip
    engine = build_engine(model, config, compile_now=False)
    engine.runner.buckets = Buckets(decode=tuple(batches), prefill_rows=(1,), chunk=tuple(chunks))
    start = time.perf_counter()
    engine.runner.compile_all()
    return engine, time.perf_counter() - start


OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "no room for the KV pool", "does not fit")


def largest_batch(candidates: list[int], try_batch) -> tuple[dict | None, dict | None]:
    """Tries try_batch(b) for each candidate in ascending order until one runs out of memory (at pool
    sizing, compile or run time). Returns (the last result that ran, the first failure {batch, error});
    an error that is not out of memory is raised, not taken for "does not fit"."""
    best = None
    for batch in sorted(candidates):
        try:
            best = try_batch(batch)
        except Exception as error:  # XlaRuntimeError has no stable public type to catch
            if not any(marker in str(error) for marker in OUT_OF_MEMORY):
                raise
            return best, {"batch": batch, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    return best, None


def _release(engine) -> None:
    import gc

    engine.runner.cache = engine.runner.token_state = None
    gc.collect()


def search_largest_batch(args, model, rng) -> tuple[dict | None, dict | None]:
    def try_batch(batch: int) -> dict:
        engine = None
        try:
            engine, _ = build(args, model, [batch], [args.context], args.context + batch + args.steps + 32)
            result = bench_decode(engine, model.config, batch, args.context, args.steps, rng)
            print(json.dumps({"fits": result}), flush=True)  # each candidate as it ends: a long search may be cut
            return result
        finally:
            if engine is not None:
                _release(engine)

    return largest_batch([int(b) for b in args.max_batch_search.split(",")], try_batch)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="4b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", default=None, help="pallas | ref (default: pallas on a GPU, ref elsewhere)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", default="1024,8192", help='prompt lengths to time ("" for none)')
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.85)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--mamba-ssm-cache-dtype", default="float32", help="the GDN states' storage: float32|bfloat16")
    parser.add_argument("--ready-only", action="store_true", help="build and compile, report times, exit")
    parser.add_argument("--max-batch-search", default=None,
                        help="e.g. 256,384,512,768: after the decode runs, the largest of these batches that fits "
                             "(pools, compile and run), each with its own engine")  # fmt: skip
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)
    from qwen35_jax.api import load_model

    start = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, kernels=args.kernels)
    args.kernels = model.kernels.name
    load_s = time.perf_counter() - start
    batches = sorted(int(b) for b in args.batches.split(","))
    chunks = sorted(int(t) for t in args.prefill.split(",") if t)  # "" measures no prefill
    rng = np.random.default_rng(0)
    # Decode: the page table spans only context + generated tokens, as a server sized for it would.
    engine, compile_decode = build(args, model, batches, [args.context], args.context + batches[-1] + args.steps + 32)
    import jax

    limits = device_limits()
    result = {"model": args.model, "kernels": args.kernels, "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
              "device": jax.devices()[0].device_kind, "limits": limits._asdict() if limits else None,
              "load_s": load_s,
              "ready_s_decode_engine": time.perf_counter() - start, "compile_s_decode_engine": compile_decode}  # fmt: skip
    print(json.dumps(result), flush=True)
    save_json(args.result_json, result)
    print("scratch bytes", {str(k): v for k, v in engine.runner.temp_bytes.items()}, flush=True)
    print("cache bytes", {n: getattr(engine.runner.cache, n).nbytes for n in ("k_pages", "ssm", "conv")}, flush=True)
    if not args.ready_only:
        result["decode"] = []
        for b in batches:
            result["decode"].append(bench_decode(engine, model.config, b, args.context, args.steps, rng))
            save_json(args.result_json, result)
        print(json.dumps(result["decode"]), flush=True)
    result["compile_seconds_decode_engine"] = {str(k): v for k, v in engine.runner.compile_seconds.items()}
    result["scratch_bytes_decode_engine"] = {str(k): v for k, v in engine.runner.temp_bytes.items()}
    _release(engine)
    if args.max_batch_search and not args.ready_only:
        result["largest_batch"], result["largest_batch_failure"] = search_largest_batch(args, model, rng)
        print(json.dumps({k: result[k] for k in ("largest_batch", "largest_batch_failure")}), flush=True)
        save_json(args.result_json, result)
    if chunks and not args.ready_only:
        engine, result["compile_s_prefill_engine"] = build(args, model, [1], chunks, chunks[-1] + 16)
        result["prefill"] = [bench_prefill(engine, model.config, t, 3, rng) for t in chunks]
        print(json.dumps(result["prefill"]), flush=True)
        result["compile_seconds_prefill_engine"] = {str(k): v for k, v in engine.runner.compile_seconds.items()}
    save_json(args.result_json, result)


def save_json(path: str | None, data) -> None:
    """Write data to path (nothing when path is None) through a temporary file, so a kill mid-write leaves the
    previous complete file. The benchmarks (this one and tools/bench_*.py) rewrite their results after every
    case or phase with it: a run stopped by its time limit on the GPU host keeps what it measured."""
    if path is None:
        return
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    main()
