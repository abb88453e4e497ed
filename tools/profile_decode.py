"""Profile steady decode steps of the engine on the GPU and summarise the device trace: kernels per step,
busy device time per step against the step's wall time (what is left is launch and host gaps).

    python tools/profile_decode.py --model 4b --batch 1 --context 1024 --trace-dir /tmp/trace
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import time

import numpy as np


def summarise(trace_dir: str, steps: int) -> dict:
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    names = {(e["pid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in names.items() if "/device:GPU" in name}
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    busy_us = sum(e["dur"] for e in kernels)
    by_name = collections.Counter()
    for e in kernels:
        by_name[e["name"].split("(")[0][:60]] += e["dur"]
    return {
        "kernels_per_step": len(kernels) / steps,
        "device_busy_ms_per_step": busy_us / steps / 1e3,
        "top_kernels_ms_per_step": {k: v / steps / 1e3 for k, v in by_name.most_common(12)},
    }


def main() -> None:
    import jax

    from qwen35_jax.api import load_model
    from qwen35_jax.serving.engine import GenerationParams
    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.serving.runner import Buckets

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trace-dir", default="/tmp/trace")
    parser.add_argument("--compile-cache", default=None)
    args = parser.parse_args()
    model = load_model(args.model)
    config = EngineConfig(
        max_batch=args.batch,
        max_prefill_tokens=args.context,
        max_model_len=args.context + 64,
        gpu_memory_fraction=0.5,
        compile_cache=args.compile_cache,
    )
    engine = build_engine(model, config, compile_now=False)
    engine.runner.buckets = Buckets(decode=(args.batch,), prefill_rows=(1,), chunk=(args.context,))
    engine.runner.compile_all()
    rng = np.random.default_rng(0)
    for _ in range(args.batch):
        engine.submit(
            rng.integers(0, 248044, args.context).tolist(), GenerationParams(60, ignore_eos=True), lambda out: None
        )

    def all_decoding():
        running = engine.scheduler.running.values()
        return len(running) == args.batch and all(r.remaining_prompt == 0 for r in running)

    while not all_decoding():
        engine.step()
    for _ in range(4):
        engine.step()
    jax.profiler.start_trace(args.trace_dir)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - start) / args.steps
    jax.profiler.stop_trace()
    report = {"batch": args.batch, "wall_ms_per_step": wall * 1e3, **summarise(args.trace_dir, args.steps)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
