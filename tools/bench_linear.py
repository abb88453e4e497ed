"""Micro-benchmark of the decode step's weight products at 4B shapes (GPU only): x [batch, in] @ W[out, in]^T in
the model's formulation (fp32 result, rounded to bf16: `model.matmul`) and with a bf16 result, each with XLA's
Triton GEMM emitter on and off (cuBLAS), beside its memory roofline (the bf16 weight read once).

    JAX_PLATFORMS=cuda python tools/bench_linear.py --batch 1 64 --json linear.json

Why: the batch-1 decode profile (docs/performance.md, session 4) has the weight GEMVs at 49-67% of HBM bandwidth;
with the Triton emitter off, XLA converted every weight to fp32 before cuBLAS because the model asks for an
fp32 result. A bf16 result (fp32 accumulation inside the product either way) lets cuBLAS read bf16 weights.

Each timed program runs `n` products on n distinct weight copies and n distinct inputs (nothing shared, so XLA
can neither merge the products nor serve a weight from the 50 MB L2); the time per product is the slope
between n = --copies and n = --copies / 2, which removes the fixed dispatch cost. The error column is the
largest |difference| from an fp32 product of the same bf16 operands, relative to that product's largest |value|.
"""

from __future__ import annotations

import argparse
import sys

from jax_timing import best_seconds, parse_gpu_benchmark_args, roofline_row

from qwen35_jax.roofline import HBM_BYTES_PER_S

# (name, out, in) at 4B: the products of one decode step (XLA merges the GDN qkv and z projections, which share x).
SHAPES_4B = (
    ("gdn_qkv_z", 12288, 2560),
    ("mlp_gate", 9216, 2560),
    ("mlp_gate_up", 18432, 2560),
    ("mlp_down", 2560, 9216),
    ("out_proj", 2560, 4096),
    ("attn_q", 8192, 2560),
)


def formulations():
    import jax.numpy as jnp
    from jax import lax

    dims = (((1,), (1,)), ((), ()))

    def f32_out(x, w):  # model.matmul
        return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)

    def bf16_out(x, w):
        return lax.dot_general(x, w, dims, preferred_element_type=x.dtype)

    return {"f32_out": f32_out, "bf16_out": bf16_out}


def pallas_tilings(args):
    """(label, linear_pallas with that tiling) for each point of the sweep grid (0: the kernel's default)."""
    import functools
    import itertools

    from qwen35_jax.kernels.linear import linear_pallas

    grid = itertools.product(args.block_n, args.block_k, args.splits, args.warps, args.stages)
    for block_n, block_k, splits, warps, stages in grid:
        tiling = {"block_n": block_n, "block_k": block_k, "splits": splits, "num_warps": warps, "num_stages": stages}
        label = "pallas " + " ".join(f"{k}={v}" for k, v in tiling.items() if v)
        yield label, tiling, functools.partial(linear_pallas, **{k: v or None for k, v in tiling.items()})


def seconds_per_product(fn, xs, ws, repeats: int, triton_gemm: bool) -> tuple[float, object]:
    import jax

    def timed(n):
        program = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws, strict=True)])
        compiled = program.lower(xs[:n], ws[:n]).compile(compiler_options={"xla_gpu_enable_triton_gemm": triton_gemm})
        out = jax.block_until_ready(compiled(xs[:n], ws[:n]))
        return best_seconds(lambda: jax.block_until_ready(compiled(xs[:n], ws[:n])), repeats), out[0]

    full, first = timed(len(ws))
    half, _ = timed(len(ws) // 2)
    return (full - half) / (len(ws) - len(ws) // 2), first


def relative_error(out, x, w) -> float:
    import jax.numpy as jnp

    truth = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T, precision="highest")
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - truth)) / jnp.max(jnp.abs(truth)))


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES_4B],
                        choices=[name for name, _, _ in SHAPES_4B])  # fmt: skip
    parser.add_argument("--copies", type=int, default=32, help="distinct weights per program (even)")
    parser.add_argument(
        "--xla",
        nargs="*",
        default=["f32_out", "bf16_out"],
        choices=["f32_out", "bf16_out"],
        help="XLA formulations to time (none: the Pallas kernel only)",
    )
    parser.add_argument(
        "--triton-gemm",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="XLA's GEMM emitter for the XLA formulations: Triton (on) or cuBLAS (off)",
    )
    for flag in ("block-n", "block-k", "splits", "warps", "stages"):
        parser.add_argument(f"--{flag}", type=int, nargs="+", default=[0], help="Pallas tiling sweep (0: default)")
    args = parse_gpu_benchmark_args(parser, argv, iters=0)
    if args is None:
        return 2
    key = jax.random.key(0)
    rows = []
    for name, out_dim, in_dim in SHAPES_4B:
        if name not in args.shapes:
            continue
        ws = [0.02 * jax.random.normal(jax.random.fold_in(key, i), (out_dim, in_dim), jnp.bfloat16)
              for i in range(args.copies)]  # fmt: skip
        floor_s = out_dim * in_dim * 2 / HBM_BYTES_PER_S
        for batch in args.batch:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (batch, in_dim), jnp.bfloat16)
                  for i in range(args.copies)]  # fmt: skip
            variants = [
                (f"{form} triton={t!s:5s}", {"formulation": form, "triton_gemm": t}, fn, t)
                for form, fn in formulations().items()
                if form in args.xla
                for t in (v == "on" for v in args.triton_gemm)
            ]
            variants += [(label, {"formulation": "pallas", **tiling}, fn, True)
                         for label, tiling, fn in pallas_tilings(args)]  # fmt: skip
            for variant, fields, fn, triton_gemm in variants:
                try:
                    seconds, out = seconds_per_product(fn, xs, ws, args.repeats, triton_gemm)
                except Exception as error:  # noqa: BLE001 - a tiling the shape refuses is reported and skipped
                    print(f"{name} batch {batch} {variant}: {type(error).__name__}: {str(error)[:200]}")
                    continue
                err = relative_error(out, xs[0], ws[0])
                label = f"{name:12s} [{out_dim:5d} x {in_dim:4d}] batch {batch:4d} {variant}"
                row = roofline_row(rows, label, seconds, floor_s, args.json, shape=name, out=out_dim, inp=in_dim,
                                   batch=batch, rel_err=err, **fields)  # fmt: skip
                print(f"    rel err {row['rel_err']:.2e}", flush=True)
        del ws
    return 0


if __name__ == "__main__":
    sys.exit(main())
