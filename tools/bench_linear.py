"""Micro-benchmark of the decode step's weight products at 4B shapes (GPU only): x [batch, in] @ W[out, in]^T in
the model's formulation (fp32 result, rounded to bf16: `linear_ref`) and with a bf16 result, each with XLA's
Triton GEMM emitter on and off (cuBLAS), beside its memory roofline (the bf16 weight read once).

    JAX_PLATFORMS=cuda python tools/bench_linear.py --batch 1 64 --json linear.json

Why: the batch-1 decode profile (docs/performance.md) had XLA's weight GEMVs at 49-67% of HBM bandwidth;
with the Triton emitter off, XLA converted every weight to fp32 before cuBLAS because the model asks for an
fp32 result. A bf16 result (fp32 accumulation inside the product either way) lets cuBLAS read bf16 weights.

Each timed program runs --copies products on distinct weight copies and distinct inputs (nothing shared, so XLA
can neither merge the products nor serve a weight from the 50 MB L2). The time per product is device time: the
sum of every kernel the program ran (the product and any split-K reduction after it) in a jax.profiler trace of
--repeats runs, divided by repeats x copies (wall-clock slopes between programs moved by up to 2x between runs:
the launch jitter is of the size of the work). The error column is the largest |difference| from an fp32 product
of the same bf16 operands, relative to that product's largest |value|.
"""

from __future__ import annotations

import argparse
import os
import sys

from jax_timing import parse_gpu_benchmark_args, roofline_row

from qwen35_jax.kernels.linear import LinearTuning
from qwen35_jax.roofline import require_device_limits

# (name, out, in) at 4B: the products of one decode step (the model's fused weights).
SHAPES_4B = (
    ("gdn_in_proj", 12352, 2560),  # qkv, z, b, a
    ("mlp_gate_up", 18432, 2560),
    ("mlp_down", 2560, 9216),
    ("out_proj", 2560, 4096),  # GDN out_proj and attention o_proj (both [hidden, 4096])
    ("attn_qkv", 10240, 2560),  # q (with its gate), k, v
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
    """(label, tiling, linear_pallas with that LinearTuning) for each point of the sweep grid (0: the default)."""
    import dataclasses
    import functools
    import itertools

    from qwen35_jax.kernels.linear import linear_pallas

    default = LinearTuning()
    grid = itertools.product(args.block_n, args.block_k, args.splits, args.warps, args.stages)
    for block_n, block_k, splits, warps, stages in grid:
        tiling = {"block_n": block_n, "block_k": block_k, "splits": splits, "num_warps": warps, "num_stages": stages}
        label = "pallas " + " ".join(f"{k}={v}" for k, v in tiling.items() if v)
        tuning = dataclasses.replace(default, **{k: v for k, v in tiling.items() if v})
        yield label, tiling, functools.partial(linear_pallas, tuning=tuning)


def seconds_per_product(fn, xs, ws, repeats: int, triton_gemm: bool, trace_dir: str) -> tuple[float, object]:
    """(device seconds per product, the first product's output) of `fn` over the xs/ws pairs (module docstring)."""
    import tempfile

    import jax
    from device_trace import trace_events

    program = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws, strict=True)])
    compiled = program.lower(xs, ws).compile(compiler_options={"xla_gpu_enable_triton_gemm": triton_gemm})
    out = jax.block_until_ready(compiled(xs, ws))
    run_dir = tempfile.mkdtemp(dir=trace_dir)  # one trace per variant: trace_events reads the newest under a dir
    jax.profiler.start_trace(run_dir)
    for _ in range(repeats):
        last = compiled(xs, ws)
    jax.block_until_ready(last)
    jax.profiler.stop_trace()
    kernels, _ = trace_events(run_dir)
    if not kernels:
        raise RuntimeError(f"no device kernels in the trace under {run_dir}")
    return sum(e["dur"] for e in kernels) * 1e-6 / (repeats * len(ws)), out[0]


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
    parser.add_argument("--copies", type=int, default=16, help="distinct weights (and inputs) per program")
    parser.add_argument("--trace-dir", default="/tmp/bench_linear_trace", help="profiler traces go under it")
    parser.add_argument("--xla", nargs="*", default=["f32_out", "bf16_out"], choices=["f32_out", "bf16_out"],
                        help="XLA formulations to time (none: the Pallas kernel only)")  # fmt: skip
    parser.add_argument("--triton-gemm", nargs="+", default=["on", "off"], choices=["on", "off"],
                        help="XLA's GEMM emitter for the XLA formulations: Triton (on) or cuBLAS (off)")  # fmt: skip
    for flag in ("block-n", "block-k", "splits", "warps", "stages"):
        parser.add_argument(f"--{flag}", type=int, nargs="+", default=[0], help="Pallas tiling sweep (0: default)")
    args = parse_gpu_benchmark_args(parser, argv, iters=0)
    if args is None:
        return 2
    os.makedirs(args.trace_dir, exist_ok=True)
    key = jax.random.key(0)
    rows = []
    for name, out_dim, in_dim in SHAPES_4B:
        if name not in args.shapes:
            continue
        ws = [0.02 * jax.random.normal(jax.random.fold_in(key, i), (out_dim, in_dim), jnp.bfloat16)
              for i in range(args.copies)]  # fmt: skip
        floor_s = out_dim * in_dim * 2 / require_device_limits().hbm_bytes_per_s
        for batch in args.batch:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (batch, in_dim), jnp.bfloat16)
                  for i in range(args.copies)]  # fmt: skip
            variants = [
                (f"{form} triton={t!s:5s}", {"formulation": form, "triton_gemm": t}, fn, t)
                for form, fn in formulations().items()
                if form in args.xla
                for t in (v == "on" for v in args.triton_gemm)
            ]
            if (
                batch <= LinearTuning().max_rows
            ):  # above it linear_pallas is XLA's product: not timed under the kernel's name
                variants += [(label, {"formulation": "pallas", **tiling}, fn, True)
                             for label, tiling, fn in pallas_tilings(args)]  # fmt: skip
            for variant, fields, fn, triton_gemm in variants:
                try:
                    seconds, out = seconds_per_product(fn, xs, ws, args.repeats, triton_gemm, args.trace_dir)
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
