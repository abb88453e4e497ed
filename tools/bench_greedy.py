"""Micro-benchmark of the step programs' greedy pick (GPU only): the chosen token and its logprob from [rows,
vocab] fp32 logits, in both of `device_sampling.greedy`'s forms, each beside the memory floor of one read of the
logits.

    JAX_PLATFORMS=cuda python tools/bench_greedy.py --batch 1 4 16 64 256 --json greedy.json

Why: at 256 rows the 4B's logits are 254 MB, so each pass over them costs ~55 us of an H200's bandwidth; the
argmax form reads them three times, the one-pass form once but with two exponentials an element. The crossover
sets `device_sampling.ONE_PASS_GREEDY_ROWS`. Times are the best of --repeats runs of --iters calls chained in one
jitted loop (each call's logits shifted by the loop index, so XLA cannot hoist the work out of the loop).
"""

from __future__ import annotations

import argparse
import sys

from jax_timing import best_seconds, parse_gpu_benchmark_args, roofline_row

from qwen35_jax.roofline import require_device_limits

VOCAB = 248320  # Qwen3.5's


def chained(form, iters: int):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def program(logits):
        def body(i, total):
            tokens, logprobs = form(logits + i.astype(jnp.float32))
            return total + logprobs.sum() + tokens.sum().astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    return program


def time_form(program, logits, repeats: int) -> float:
    """Seconds a run of the chained program, best of `repeats` after one warm-up."""
    import jax

    jax.block_until_ready(program(logits))
    return best_seconds(lambda: jax.block_until_ready(program(logits)), repeats)


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    from qwen35_jax.serving import device_sampling

    args = parse_gpu_benchmark_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), argv, iters=50)
    if args is None:
        return 1
    bandwidth = require_device_limits().hbm_bytes_per_s
    forms = {"argmax": device_sampling.greedy_by_argmax, "one_pass": device_sampling.greedy_one_pass}
    rows = []
    for batch in args.batch:
        logits = 4.0 * jax.random.normal(jax.random.key(batch), (batch, VOCAB), jnp.float32)
        for name, form in forms.items():
            seconds = time_form(chained(form, args.iters), logits, args.repeats) / args.iters
            roofline_row(rows, f"batch {batch:4d} {name:9s}", seconds, logits.nbytes / bandwidth, args.json,
                         batch=batch, form=name)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
