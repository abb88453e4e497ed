"""`--decode-overlap off` against `stream` on one GPU, with random weights at a preset's shapes.

For each mode it builds a runner over the same weights, compiles the step programs of a few buckets in parallel,
and reports:
- how each unified program ran in a profiler trace: the streams its kernels ran on, their summed time and their
  span (below the sum only where kernels ran at once);
- each program's device time (`Runner.measure_step_costs`: repeated runs dispatched back to back on padding inputs), beside the
  sum of its two sides run as separate programs (decode-only + prefill-only);
- greedy parity: the same workload on both modes' engines, with the same plans (no overlap budget, so both
  schedulers plan alike), must give the same tokens.

    python tools/overlap_ab.py --model 4b --batches 1,16 --chunks 256,1024 --requests 64 --out overlap_ab.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np


def build_runner(model, mode: str, batches, chunks, max_model_len: int, num_pages: int):
    from qwen35_jax.cache import CacheSpec
    from qwen35_jax.serving.runner import Buckets, Runner

    spec = CacheSpec(num_pages, 16, max(batches) + 1)
    buckets = Buckets(decode=tuple(batches), prefill_rows=(1,), chunk=tuple(chunks))
    return Runner(model.model_def, model.params, model.kernels, spec, buckets, max_model_len, decode_overlap=mode)


def traced_streams(runner, key, runs: int = 5) -> dict:
    """Runs program `key` on padding inputs `runs` times under the profiler: {"streams": the trace lanes its
    kernels ran on (copies aside), "kernel_sum_ms" and "span_ms" per run}."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_trace import traced_program

    kernels = [e for e in traced_program(runner, key, runs) if "memcpy" not in e["name"].lower()]
    lanes = collections.Counter(f"{e['pid']}/{e['tid']}" for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    return {"streams": len(lanes), "kernel_sum_ms": sum(e["dur"] for e in kernels) / runs / 1e3,
            "span_ms": span / runs / 1e3}  # fmt: skip


def greedy_tokens(runner, batches, requests, seed: int) -> list[list[int]]:
    from qwen35_jax.serving.engine import Engine, GenerationParams
    from qwen35_jax.serving.scheduler import Scheduler, SchedulerConfig

    spec = runner.spec
    config = SchedulerConfig(max_batch=max(batches), max_prefill_tokens=max(runner.buckets.chunk), page_size=16,
                             num_pages=spec.num_pages, num_slots=spec.num_slots,
                             max_model_len=runner.page_table_width * 16)  # fmt: skip
    engine = Engine(runner, Scheduler(config), None, ())
    rng = np.random.default_rng(seed)
    out: dict[str, list[int]] = {}

    def collect(output):
        out.setdefault(output.request_id, []).extend(output.token_ids)

    ids = []
    for _ in range(requests):
        prompt = rng.integers(3, 200_000, int(rng.integers(20, 1500))).tolist()
        ids.append(engine.submit(prompt, GenerationParams(max_tokens=8, ignore_eos=True), collect))
    engine.run_until_done()
    return [out[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--chunks", default="256,1024")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", default="pallas")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from qwen35_jax.api import load_model

    batches = [int(x) for x in args.batches.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    model = load_model(args.model, dtype=args.dtype, kernels=args.kernels)
    result = {"model": args.model, "batches": batches, "chunks": chunks, "modes": {}}
    tokens = {}
    for mode in ("off", "stream"):
        runner = build_runner(model, mode, batches, chunks, max_model_len=2048, num_pages=4096)
        start = time.perf_counter()
        runner.compile_all()
        compile_s = time.perf_counter() - start
        unified = [k for k in runner.buckets.keys() if k[0] and k[1]]
        traces = {str(k): traced_streams(runner, k) for k in unified}
        costs = runner.measure_step_costs(runner.buckets.keys(), repeats=args.repeats)
        sequential = {str(k): costs[(k[0], 0, 0)] + costs[(0, k[1], k[2])] for k in unified}
        tokens[mode] = greedy_tokens(runner, batches, args.requests, seed=0)
        result["modes"][mode] = {
            "compile_s": compile_s,
            "traces": traces,
            "step_ms": {str(k): v * 1e3 for k, v in costs.items()},
            "sides_in_sequence_ms": {k: v * 1e3 for k, v in sequential.items()},
            "scratch_mib": {str(k): v / 2**20 for k, v in runner.temp_bytes.items()},
        }
        print(json.dumps({mode: result["modes"][mode]}), flush=True)
        del runner
    same = sum(a == b for a, b in zip(tokens["off"], tokens["stream"], strict=True))
    result["greedy_parity"] = {"requests": args.requests, "identical": same}
    print(json.dumps(result["greedy_parity"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
