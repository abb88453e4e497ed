"""`--deterministic` on a GPU: the same prompts give the same greedy tokens at batch 1, 8 and 64, and what the mode
costs in TPOT at batch 1 and 64 against the default engine, written as JSON.

    python tools/deterministic_check.py OUT.json [--model 4b] [--max-batch 64] [--modes deterministic,default]

Both engines (`EngineConfig(deterministic=...)`, the rest equal) run the same 64 random prompts of 40-300 tokens
(so that prompts cross the 256-token chunk boundary), 32 greedy tokens each with their logprobs: each prompt alone,
then in groups of 8, then all 64 at once. A prompt's results count as equal when its tokens and their logprobs are
bit-identical to its lone run. TPOT is the median over requests of (last token time - first token time) / (n - 1),
from the engine's output callbacks, for 1 and for 64 requests of 128 prompt tokens and 256 output tokens started
together, and the median gap between a request's deliveries (ITL p50: the decode step, where prefill steps do
not land). Programs compile on first use (and warm-up), so that the default engine builds only what it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def run(engine, requests) -> list[dict]:
    """Submit all at once, run until idle; per request: tokens, logprobs and each delivery's time."""
    outputs = {}

    def on_output(output):
        entry = outputs.setdefault(output.request_id, {"tokens": [], "logprobs": [], "times": []})
        entry["tokens"] += output.token_ids
        entry["logprobs"] += [lp.logprob for lp in output.logprobs or ()]
        entry["times"] += [time.perf_counter()] * len(output.token_ids)

    ids = [engine.submit(prompt, params, on_output) for prompt, params in requests]
    engine.run_until_done()
    return [outputs[i] for i in ids]


def in_groups(engine, requests, size: int) -> list[dict]:
    return [result for start in range(0, len(requests), size) for result in run(engine, requests[start : start + size])]


def tpot_ms(results: list[dict]) -> float:
    return 1e3 * statistics.median((r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results)


def tpot_by_batch(engine, prompts, params, batches) -> dict:
    tpot = {}
    for batch in batches:
        run(engine, [(p, params) for p in prompts[:batch]])  # warm-up at this batch
        results = run(engine, [(p, params) for p in prompts[:batch]])
        gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False) if b > a]
        tpot[batch] = {"tpot": tpot_ms(results), "itl_p50": 1e3 * statistics.median(gaps)}
    return tpot


def check_tokens(engine, prompts, params) -> dict:
    requests = [(p, params) for p in prompts]
    run(engine, requests[:8])  # warm-up: compiles what the runs below use
    by_batch = {size: in_groups(engine, requests, size) for size in (1, 8, 64)}
    lone = by_batch[1]
    same = {size: sum(r["tokens"] == a["tokens"] and r["logprobs"] == a["logprobs"] for r, a in zip(results, lone, strict=True))
            for size, results in by_batch.items()}  # fmt: skip
    same_tokens = {size: sum(r["tokens"] == a["tokens"] for r, a in zip(results, lone, strict=True))
                   for size, results in by_batch.items()}  # fmt: skip
    return {"bit_identical_to_lone": same, "same_tokens_as_lone": same_tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="4b")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--modes", default="deterministic,default", help="which engines, in order")
    parser.add_argument("--tpot-batches", default="1,64", help="batch sizes of the TPOT runs")
    parser.add_argument("--skip-tokens", default="", help="modes whose token check is skipped (compile time)")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from qwen35_jax.api import load_model
    from qwen35_jax.serving.engine import GenerationParams
    from qwen35_jax.serving.factory import EngineConfig, build_engine

    model = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(40, 300, 64)]
    tpot_prompts = [rng.integers(3, vocab, 128).tolist() for _ in range(64)]
    params = GenerationParams(max_tokens=32, ignore_eos=True, logprobs=0)
    tpot_params = GenerationParams(max_tokens=256, ignore_eos=True)
    result = {"model": args.model, "device": jax.devices()[0].device_kind, "max_batch": args.max_batch}
    for name in args.modes.split(","):
        config = EngineConfig(max_batch=args.max_batch, max_prefill_tokens=256, max_model_len=1024,
                              gpu_memory_fraction=0.5, deterministic=name == "deterministic",
                              compile_cache=args.compile_cache)  # fmt: skip
        start = time.perf_counter()
        engine = build_engine(model, config, compile_now=False)
        result[name] = {} if name in args.skip_tokens.split(",") else check_tokens(engine, prompts, params)
        batches = [int(b) for b in args.tpot_batches.split(",")]
        result[name]["tpot_ms"] = tpot_by_batch(engine, tpot_prompts, tpot_params, batches)
        result[name]["seconds"] = round(time.perf_counter() - start, 1)
        engine.shutdown()
        del engine
        print(name, json.dumps(result[name]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
