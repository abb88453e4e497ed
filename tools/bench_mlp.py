"""Micro-benchmark of the MLP block at 4B shapes (GPU only): is one fused gate/up projection faster than two?

The batch-1 decode profile (docs/performance.md, session 4) has the MLP gate and up projections as two GEMV
kernels per layer at 49% of HBM bandwidth (1.43 ms a step for 3.0 GB), while XLA merged the GDN layer's qkv and z
projections into one 12288-wide GEMV that reaches 61%. This times, per MLP block, the model's formulation
(`model.MLP`: gate and up as two products with fp32 accumulation and bf16 results, silu(gate) * up, down) against
the same block with gate and up stored as one [2 x intermediate, hidden] weight (one product, split after), each
beside its memory roofline (the three weights read once).

    JAX_PLATFORMS=cuda python tools/bench_mlp.py --batch 1 16 64 256 --json mlp.json

Each timed program chains --iters blocks through distinct weight copies (--layers of them, cycled, more bytes than
the 50 MB L2 holds, as consecutive layers are), each block's output feeding the next block's input, so XLA can
neither merge the calls nor serve the weights from cache.
"""

from __future__ import annotations

import argparse
import sys

from jax_timing import best_seconds, parse_gpu_benchmark_args, roofline_row

from qwen35_jax.roofline import HBM_BYTES_PER_S


def blocks():
    import jax
    import jax.numpy as jnp

    from qwen35_jax.model import matmul

    def separate(x, gate, up, down):  # model.MLP
        g = matmul(x, gate)
        return matmul(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * matmul(x, up), down)

    def fused(x, gate_up, down):  # one product over [gate; up]
        g, u = jnp.split(matmul(x, gate_up), 2, axis=-1)
        return matmul(jax.nn.silu(g.astype(jnp.float32)).astype(x.dtype) * u, down)

    return {"separate": separate, "fused_gate_up": fused}


def weights(name: str, layers: int, hidden: int, inter: int):
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    out = []
    for i in range(layers):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
        gate = 0.02 * jax.random.normal(k1, (inter, hidden), jnp.bfloat16)
        up = 0.02 * jax.random.normal(k2, (inter, hidden), jnp.bfloat16)
        down = 0.02 * jax.random.normal(k3, (hidden, inter), jnp.bfloat16)
        out.append((gate, up, down) if name == "separate" else (jnp.concatenate([gate, up]), down))
    return out


def time_block(fn, x, layer_weights, iters: int, repeats: int) -> float:
    import jax

    def program(x, layer_weights):
        for i in range(iters):
            x = fn(x, *layer_weights[i % len(layer_weights)])
        return x

    compiled = jax.jit(program).lower(x, layer_weights).compile()
    jax.block_until_ready(compiled(x, layer_weights))
    return best_seconds(lambda: jax.block_until_ready(compiled(x, layer_weights)), repeats) / iters


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--intermediate", type=int, default=9216)
    parser.add_argument("--layers", type=int, default=4, help="distinct weight copies cycled through")
    args = parse_gpu_benchmark_args(parser, argv, iters=32)
    if args is None:
        return 2
    floor_s = 3 * args.hidden * args.intermediate * 2 / HBM_BYTES_PER_S
    rows = []
    for name, fn in blocks().items():
        layer_weights = weights(name, args.layers, args.hidden, args.intermediate)
        for batch in args.batch:
            x = jax.random.normal(jax.random.key(batch), (batch, args.hidden), jnp.bfloat16)
            seconds = time_block(fn, x, layer_weights, args.iters, args.repeats)
            roofline_row(rows, f"{name:14s} batch {batch:4d}", seconds, floor_s, args.json, block=name, batch=batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
