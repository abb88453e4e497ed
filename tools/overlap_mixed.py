"""The mixed-load cell in process, `--decode-overlap off` against `stream`: decoders stream tokens while long
prompts arrive at a fixed rate; prints each mode's decoder inter-token latency (p50/p99/max) and the long
prompts' time to first token, measured at the engine's output callback (no HTTP).

The engine keeps the bucket set small (decode rows padded to --decoders, chunk buckets --chunks), so that both
modes compile in a few minutes at 4B.

    python tools/overlap_mixed.py --model 4b --decoders 16 --decode-len 256 --long 8192 --arrivals 6 --rate 1
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np


def build(model, mode: str, args):
    """mode: off, stream, or stream-noregions (stream's scheduling over off's serialised programs, to tell the two apart)."""
    from qwen35_jax.serving import runner as runner_module
    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.serving.runner import Buckets

    overlaps = runner_module.overlaps_sides
    if mode == "stream-noregions":
        runner_module.overlaps_sides = lambda *_: False
        mode = "stream"

    config = EngineConfig(max_batch=args.decoders + 1, max_prefill_tokens=max(args.chunks), max_model_len=args.long + 64,
                          gpu_memory_fraction=0.4, decode_overlap=mode, overlap_step_bound=args.bound,
                          compile_cache=args.compile_cache)  # fmt: skip
    try:
        engine = build_engine(model, config, compile_now=False)
    finally:
        runner_module.overlaps_sides = overlaps
    engine.runner.buckets = Buckets(decode=(args.decoders + 1,), prefill_rows=(1,), chunk=tuple(args.chunks))
    if mode == "stream":
        from qwen35_jax.serving.factory import compile_overlapped

        engine.scheduler.overlap_budget = compile_overlapped(engine.runner, args.bound)
    else:
        engine.runner.compile_all()
    return engine


def run_cell(engine, args, seed: int) -> dict:
    from qwen35_jax.serving.engine import GenerationParams

    rng = np.random.default_rng(seed)
    stamps: dict[str, list[float]] = {}

    def on_output(output):
        if output.token_ids:
            stamps.setdefault(output.request_id, []).append(time.perf_counter())

    decoders = [engine.submit(rng.integers(3, 200_000, 128).tolist(),
                              GenerationParams(max_tokens=args.decode_len, ignore_eos=True), on_output)
                for _ in range(args.decoders)]  # fmt: skip
    while any(len(stamps.get(d, ())) < 2 for d in decoders):
        engine.step()
    start, arrivals = time.perf_counter(), {}
    while engine.has_work():
        due = int((time.perf_counter() - start) * args.rate) + 1
        while len(arrivals) < min(due, args.arrivals):
            rid = engine.submit(rng.integers(3, 200_000, args.long).tolist(), GenerationParams(max_tokens=16,
                                ignore_eos=True), on_output)  # fmt: skip
            arrivals[rid] = time.perf_counter()
        engine.step()
    itl = np.concatenate([np.diff(stamps[d]) for d in decoders]) * 1e3
    ttft = [(stamps[r][0] - t) * 1e3 for r, t in arrivals.items()]
    return {"itl_ms": {"p50": float(np.percentile(itl, 50)), "p99": float(np.percentile(itl, 99)),
                       "max": float(itl.max())},
            "long_ttft_ms": {"p50": float(np.median(ttft)), "max": float(max(ttft))},
            "arrived": len(arrivals)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b")
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decode-len", type=int, default=256)
    parser.add_argument("--long", type=int, default=8192)
    parser.add_argument("--arrivals", type=int, default=6)
    parser.add_argument("--rate", type=float, default=1.0, help="long prompts per second")
    parser.add_argument("--chunks", default="64,256,1024")
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--modes", default="off,stream")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--kernels", default="pallas")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.chunks = [int(x) for x in args.chunks.split(",")]
    from qwen35_jax.api import load_model

    model = load_model(args.model, dtype=args.dtype, kernels=args.kernels)
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    for mode in args.modes.split(","):
        engine = build(model, mode, args)
        budget = engine.scheduler.overlap_budget
        result[mode] = run_cell(engine, args, seed=0) | {"budget": None if budget is None else budget.limits}
        print(json.dumps({mode: result[mode]}), flush=True)
        del engine
        gc.collect()  # the next mode's KV pool is sized from free memory
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
