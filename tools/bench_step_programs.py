"""Device time of step programs (B decode rows, P prompt chunks of T tokens) at a preset's shapes, each compiled on
its own and run back to back on padding inputs (`Runner.measure_step_costs`), beside the prefill FLOP floor of
its P x T tokens.

    python3 tools/bench_step_programs.py --model 4b --keys 0,1,1024 0,8,128 0,16,64 --json steps.json
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    from qwen35_jax.api import load_model
    from qwen35_jax.cache import CacheSpec
    from qwen35_jax.roofline import require_device_limits
    from qwen35_jax.serving.factory import enable_compile_cache
    from qwen35_jax.serving.offline_bench import prefill_floor_flops
    from qwen35_jax.serving.runner import CONCURRENT_GRAPH, Buckets, Runner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b")
    parser.add_argument("--keys", nargs="+", required=True, help="B,P,T of each program")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kernels", default="pallas")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--autotuned-gemms",
        action="store_true",
        help="XLA's autotuned GEMMs in every program (the runner pins cuBLAS's for decode rows)",
    )
    parser.add_argument("--decode-overlap", default="off", choices=("off", "stream"))
    parser.add_argument(
        "--concurrent-graph",
        action="store_true",
        help="every program's command buffer concurrent (the runner makes only stream's unified ones so)",
    )
    args = parser.parse_args()
    if args.autotuned_gemms:
        Runner.compiler_options = lambda self, family, key: None
    if args.concurrent_graph:
        plain = Runner.compiler_options
        Runner.compiler_options = lambda self, family, key: {**(plain(self, family, key) or {}), **CONCURRENT_GRAPH}
    enable_compile_cache(args.compile_cache)
    keys = [tuple(int(x) for x in k.split(",")) for k in args.keys]
    model = load_model(args.model, dtype="bfloat16", kernels=args.kernels)
    buckets = Buckets(decode=tuple(sorted({k[0] for k in keys if k[0]})) or (1,),
                      prefill_rows=tuple(sorted({k[1] for k in keys if k[1]})) or (1,),
                      chunk=tuple(sorted({k[2] for k in keys if k[2]})) or (16,))  # fmt: skip
    spec = CacheSpec(4096, 16, max(buckets.decode) + 1)
    runner = Runner(
        model.model_def, model.params, model.kernels, spec, buckets, 4096, decode_overlap=args.decode_overlap
    )
    runner.compile_all(keys=keys)
    costs = runner.measure_step_costs(keys, repeats=args.repeats)
    rows = []
    for key in keys:
        tokens = key[1] * key[2]
        # P separate prompts: P x the floor of one T-token prompt (attention is causal within each).
        floor = (
            key[1] * prefill_floor_flops(model.config, key[2]) / require_device_limits().bf16_flops_per_s
            if tokens
            else None
        )
        row = {"key": list(key), "ms": costs[key] * 1e3, "prefill_floor_ms": floor and floor * 1e3,
               "scratch_mib": runner.temp_bytes[key] / 2**20}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "decode_overlap": args.decode_overlap,
                       "concurrent_graph": args.concurrent_graph, "programs": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
