"""Micro-benchmark of the lm_head at 4B shapes (GPU only): the final RMSNorm and the product with the tied
embedding [vocab, hidden], fp32 logits, as `model.Embedding.logits` computes them, in a few formulations and
with XLA's Triton GEMM emitter on and off, each beside its memory roofline (the bf16 embedding read once).

    JAX_PLATFORMS=cuda python tools/bench_lm_head.py --batch 1 16 64 256 --json lm_head.json

Why: the batch-1 decode profile (docs/performance.md) shows the lm_head fusion at 1.43 ms a step for 1.27 GB of
weights (0.89 TB/s) while the other weight GEMMs reach ~3.8 TB/s. Times are the best of --repeats runs of
--iters calls chained through their input (each call's logits perturb the next call's hidden state), so
XLA cannot merge the calls.
"""

from __future__ import annotations

import argparse
import sys

from jax_timing import best_seconds, parse_gpu_benchmark_args, roofline_row

from qwen35_jax.roofline import require_device_limits


def formulations():
    import jax.numpy as jnp
    from jax import lax

    def rms(h, w):
        h32 = h.astype(jnp.float32)
        return (h32 * lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6) * (1.0 + w.astype(jnp.float32))).astype(
            h.dtype
        )

    def f32_logits(h, w, emb):  # the model's formulation
        return lax.dot_general(rms(h, w), emb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def bf16_logits(h, w, emb):  # bf16 result, upcast (HF's own rounding of the logits)
        return lax.dot_general(rms(h, w), emb, (((1,), (1,)), ((), ()))).astype(jnp.float32)

    def f32_logits_nonorm(h, w, emb):  # the product alone: does fusing the norm into the GEMM cost?
        return lax.dot_general(h, emb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    return {"f32_logits": f32_logits, "bf16_logits": bf16_logits, "f32_logits_nonorm": f32_logits_nonorm}


def time_one(fn, h, w, emb, iters: int, repeats: int, triton_gemm: bool) -> float:
    import jax

    def program(h, w, emb):
        for _ in range(iters):
            logits = fn(h, w, emb)
            h = h + (logits[:, :1] * 1e-9).astype(h.dtype)  # a dependency, not a change of the work
        return h

    compiled = jax.jit(program).lower(h, w, emb).compile(compiler_options={"xla_gpu_enable_triton_gemm": triton_gemm})
    jax.block_until_ready(compiled(h, w, emb))
    return best_seconds(lambda: jax.block_until_ready(compiled(h, w, emb)), repeats) / iters


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--hidden", type=int, default=2560)
    args = parse_gpu_benchmark_args(parser, argv, iters=20)
    if args is None:
        return 2
    key = jax.random.key(0)
    emb = jax.random.normal(key, (args.vocab, args.hidden), jnp.bfloat16)
    w = jnp.zeros((args.hidden,), jnp.bfloat16)
    floor_s = emb.size * 2 / require_device_limits().hbm_bytes_per_s
    rows = []
    for batch in args.batch:
        h = jax.random.normal(jax.random.fold_in(key, batch), (batch, args.hidden), jnp.bfloat16)
        for name, fn in formulations().items():
            for triton_gemm in (True, False):
                seconds = time_one(fn, h, w, emb, args.iters, args.repeats, triton_gemm)
                label = f"batch {batch:4d} {name:18s} triton_gemm={triton_gemm!s:5s}"
                roofline_row(rows, label, seconds, floor_s, args.json, batch=batch, formulation=name,
                             triton_gemm=triton_gemm)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
