"""Micro-benchmark of the residual add + RMSNorm kernel (`kernels/residual_norm.py`) on one GPU at Qwen3.5-4B's
hidden size (2560, bf16) against the jitted XLA reference, which is what the `pallas` set runs.

    JAX_PLATFORMS=cuda python tools/bench_residual_norm.py --batch 1 16 32 --splits 8 1 --json residual_norm.json

Time is device time a call: `iters` calls chained in one jitted loop (h fed back, as the residual stream is from
norm point to norm point), the best of `--repeats` runs, so host dispatch is not counted. The work is memory
bound: the roofline is bytes / 4.3 TB/s, with the fp32 partials, h and the weight read once, h' and the normed
rows written once. A few kilobytes a call cannot approach that figure: the launch and one dependent chain of
loads, a reduction and stores set the time, so the column to read is the ratio to XLA's kernels.
"""

from __future__ import annotations

import argparse
import json
import sys

from jax_timing import chained_seconds

from qwen35_jax.roofline import HBM_BYTES_PER_S

HIDDEN, EPS = 2560, 1e-6


def case(batch: int, splits: int):
    import jax
    import jax.numpy as jnp

    kh, kp, kw = jax.random.split(jax.random.key(batch * 16 + splits), 3)
    h = jax.random.normal(kh, (batch, HIDDEN)).astype(jnp.bfloat16)
    partials = jax.random.normal(kp, (splits, batch, HIDDEN), jnp.float32)
    weight = (0.3 * jax.random.normal(kw, (HIDDEN,))).astype(jnp.bfloat16)
    return h, partials, weight


def traffic(h, partials, weight) -> int:
    """Bytes of one call: partials, h and the weight read; h' and the normed rows written."""
    return partials.nbytes + 3 * h.nbytes + weight.nbytes


def seconds_per_call(add_norm, h, partials, weight, iters: int, repeats: int) -> float:
    def step(_, h):
        new_h, normed = add_norm(h, partials, weight, EPS)
        return normed, new_h

    return chained_seconds(step, h, h, iters, repeats)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--splits", type=int, nargs="+", default=[8, 1], help="partials a call (4B: 8 or 1)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write every result row to this file")
    args = parser.parse_args()

    import jax

    from qwen35_jax.kernels.residual_norm import add_rms_norm_pallas, add_rms_norm_ref

    if jax.devices()[0].platform != "gpu":
        sys.exit(f"bench_residual_norm needs a GPU; JAX runs on {jax.devices()[0].platform} (set JAX_PLATFORMS=cuda)")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, hidden {HIDDEN}")
    results = []
    for batch in args.batch:
        for splits in args.splits:
            h, partials, weight = case(batch, splits)
            moved = traffic(h, partials, weight)
            ref = seconds_per_call(add_rms_norm_ref, h, partials, weight, args.iters, args.repeats)
            ours = seconds_per_call(add_rms_norm_pallas, h, partials, weight, args.iters, args.repeats)
            floor = moved / HBM_BYTES_PER_S
            row = dict(batch=batch, splits=splits, bytes=moved, kernel_us=ours * 1e6, ref_us=ref * 1e6,
                       roofline_us=floor * 1e6, roofline_pct=100 * floor / ours, ref_over_kernel=ref / ours)  # fmt: skip
            results.append(row)
            print(f"batch {batch:3d} partials {splits}: kernel {ours * 1e6:6.2f} us  XLA ref {ref * 1e6:6.2f} us  "
                  f"x{ref / ours:4.2f}  {moved / 1e3:7.1f} KB  floor {floor * 1e6:5.2f} us "
                  f"({100 * floor / ours:4.1f}% of 4.3 TB/s)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
