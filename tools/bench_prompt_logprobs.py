"""What prompt logprobs and the repetition penalty cost at a preset's shapes, with random weights, on padding inputs:
- device time and scratch of the prefill-only step (0, 1, T) beside the prompt-logprobs step of the same T (the
  logits of every position, the next token's logprob and rank, the top-N);
- device time of the sampler row program at R rows (every row under a repetition penalty, reading its slot's prompt
  mask) and of the mark_prompt program over a T-token chunk.

Each figure is a run of `repeats` launches dispatched back to back and waited for once, after one waited-for run.

    python tools/bench_prompt_logprobs.py --model 4b --kernels ref --chunks 16,256 --rows 17 --out prompt_logprobs.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def device_seconds(launch, repeats: int) -> float:
    """Seconds per launch of `launch()` (which returns arrays to wait for)."""
    import jax

    jax.block_until_ready(launch())
    start = time.perf_counter()
    for _ in range(repeats):
        out = launch()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def scratch_mib(executable) -> float:
    memory = executable.memory_analysis()
    return getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory is not None else 0.0


def step_costs(runner, t: int, repeats: int) -> dict:
    key = (0, 1, t)
    step, scored = runner.compile(key), runner.prompt_program(t)
    inputs, targets = runner.padding_inputs(key), np.zeros(t, np.int32)

    def plain():
        runner.cache, runner.token_state, outputs, _ = step(runner._param_leaves, runner.cache, runner.token_state,
                                                            inputs)  # fmt: skip
        return outputs

    def with_prompt_logprobs():
        runner.cache, runner.token_state, _, _, outputs = scored(runner._param_leaves, runner.cache,
                                                                 runner.token_state, inputs, targets)  # fmt: skip
        return outputs

    return {"chunk": t, "prefill_ms": 1e3 * device_seconds(plain, repeats),
            "prompt_logprobs_ms": 1e3 * device_seconds(with_prompt_logprobs, repeats),
            "prefill_scratch_mib": scratch_mib(step), "prompt_logprobs_scratch_mib": scratch_mib(scored)}  # fmt: skip


def row_costs(runner, rows: int, t: int, repeats: int) -> dict:
    from qwen35_jax.serving.device_sampling import SamplingRows
    from qwen35_jax.serving.engine import SamplingRow

    vocab = runner.model_def.cfg.vocab_size
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    no_grammar = np.full((rows, runner.mask_words), -1, np.int32)  # every token allowed, as a row without a grammar
    sampling = SamplingRows.from_rows([SamplingRow(0.0, 0, 1.0, 0.0, 0, 3, repetition_penalty=1.2)] * rows, rows,
                                      no_grammar)  # fmt: skip
    slots, tokens = np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32)
    sampler, mark = runner.row_program("sample", rows), runner.row_program("mark_prompt", t)
    fresh = np.zeros(runner.buckets.prefill_rows[-1], np.int32)
    token_slots, token_ids = np.zeros(t, np.int32), np.arange(t, dtype=np.int32)

    def sample():
        runner.token_state, runner.output_counts, out, _ = sampler(logits, sampling, runner.token_state,
                                                                   runner.output_counts, runner.prompt_mask, slots,
                                                                   tokens)  # fmt: skip
        return out

    def mark_prompt():
        runner.prompt_mask = mark(runner.prompt_mask, fresh, token_slots, token_ids)
        return runner.prompt_mask

    return {"rows": rows, "sampler_ms": 1e3 * device_seconds(sample, repeats),
            "mark_prompt_ms": 1e3 * device_seconds(mark_prompt, repeats), "mark_chunk": t,
            "prompt_mask_mib": runner.prompt_mask.nbytes / 2**20,
            "output_counts_mib": runner.output_counts.nbytes / 2**20}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="4b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", default=None, help="pallas or ref (default: the platform's)")
    parser.add_argument("--chunks", default="16,256", help="chunk buckets T, comma-separated")
    parser.add_argument("--rows", type=int, default=17, help="sampler rows R (also the GDN slots)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    import jax

    from qwen35_jax.api import load_model
    from qwen35_jax.cache import CacheSpec
    from qwen35_jax.serving.runner import Buckets, Runner

    chunks = tuple(int(c) for c in args.chunks.split(","))
    model = load_model(args.model, dtype=args.dtype, kernels=args.kernels)
    buckets = Buckets(decode=(1,), prefill_rows=(1,), chunk=chunks, prompt_logprobs_chunk=chunks)
    runner = Runner(model.model_def, model.params, model.kernels, CacheSpec(64, 16, args.rows), buckets, max(chunks))
    result = {"device": str(jax.devices()[0]), "model": args.model, "dtype": args.dtype,
              "steps": [step_costs(runner, t, args.repeats) for t in chunks],
              "rows": row_costs(runner, args.rows, chunks[-1], args.repeats)}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
