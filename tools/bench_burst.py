"""Time to first token of N prompts of L tokens submitted together, in process (the engine's output callback, no
HTTP), for each `--max-prefill-chunks` given: how short prompts that arrive at once share prefill steps.

Each engine compiles the programs the burst uses (lazily, in two bursts that are not counted), then runs
`--repeats` bursts on random prompts.

    python3 tools/bench_burst.py --model 4b --prompts 16 --prompt-len 128 --chunks 1,8 --json burst.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np


def burst(engine, args, seed: int) -> list[float]:
    """TTFT in ms of each request of one burst, in submission order."""
    from qwen35_jax.serving.engine import GenerationParams

    rng = np.random.default_rng(seed)
    first: dict[str, float] = {}

    def on_output(output):
        if output.token_ids:
            first.setdefault(output.request_id, time.perf_counter())

    start = time.perf_counter()
    ids = [engine.submit(rng.integers(3, 200_000, args.prompt_len).tolist(),
                         GenerationParams(max_tokens=args.max_tokens, ignore_eos=True), on_output)
           for _ in range(args.prompts)]  # fmt: skip
    engine.run_until_done()
    return [(first[i] - start) * 1e3 for i in ids]


def main() -> None:
    from qwen35_jax.api import load_model
    from qwen35_jax.serving.factory import EngineConfig, build_engine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--chunks", default="1,8", help="--max-prefill-chunks values to compare")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-prefill-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", default=None)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = load_model(args.model, kernels=args.kernels)
    report = {"model": args.model, "prompts": args.prompts, "prompt_len": args.prompt_len, "runs": {}}
    for chunks in [int(c) for c in args.chunks.split(",")]:
        config = EngineConfig(max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                              max_prefill_chunks=chunks, max_model_len=args.prompt_len + args.max_tokens + 64,
                              gpu_memory_fraction=0.3, compile_cache=args.compile_cache)  # fmt: skip
        engine = build_engine(model, config, compile_now=False)
        for warm in range(2):  # compiles what the bursts run
            burst(engine, args, seed=100 + warm)
        compiled = engine.runner.num_compiles + engine.runner.num_row_compiles
        ttft = np.array([burst(engine, args, seed=1 + r) for r in range(args.repeats)])
        compiled = engine.runner.num_compiles + engine.runner.num_row_compiles - compiled
        run = {"programs_compiled_while_timed": compiled,"ttft_p50_ms": float(np.median(ttft)), "ttft_mean_ms": float(ttft.mean()),
               "ttft_max_ms": float(ttft.max()), "per_burst_p50_ms": np.median(ttft, axis=1).tolist()}  # fmt: skip
        report["runs"][str(chunks)] = run
        print(json.dumps({"max_prefill_chunks": chunks, **run}), flush=True)
        del engine
        gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
