"""Micro-benchmark of the GDN one-token decode on one GPU at Qwen3.5-4B shapes (nk 16, nv 32, dk = dv = 128):
the Pallas in-pool kernel against the jitted XLA reference and, when torch and flash-linear-attention are
importable, fla's Triton `fused_recurrent_gated_delta_rule` (l2norm in the kernel, as here).

    JAX_PLATFORMS=cuda python tools/bench_gdn_decode.py --batch 1 8 64 256
    JAX_PLATFORMS=cuda python tools/bench_gdn_decode.py --batch 256 --sweep    # every (block_dv, num_warps)
    JAX_PLATFORMS=cuda python tools/bench_gdn_decode.py --pool --batch 1 8 64 256   # in the slot pool, below

Each (block_dv, num_warps) is passed to the kernel as a `GdnDecodeTuning`. Without --pool the states are a
[batch, nv, dk, dv] array, run through the kernel as a one-layer pool whose slots are the rows in order.
Time is device time a call: `iters` calls chained in one jitted loop (the state carried, as in serving), the
best of `--repeats` runs, so host dispatch is not counted (fla: `iters` calls replayed from one CUDA graph).
The kernel is memory bound; the roofline is bytes moved / the card's HBM bandwidth (4.3 TB/s on the H200) (the fp32 state read and written once
dominates: 2 * 4 * dk * dv bytes a head). XLA may hoist the loop-invariant l2norm of q, k out of the
reference's loop, which flatters the reference slightly.

--pool: the states live in a slot pool [layers, batch + 1, nv, dk, dv] fp32 (24 layers as at 4B; the last slot
is the engine's trash slot, unused here) and the batch's rows are its other slots in shuffled order. It times
(a) "XLA gather+ref+scatter": `gdn_decode_pool_ref`, which gathers the rows of one layer, runs the reference step
and scatters them back, against (b) "in-pool pallas": `gdn_decode_pool_pallas` updating the rows in the
pool. Both are chained through the donated pool in one jitted loop whose iteration i updates layer i % layers,
as the model walks its layers (one layer's rows alone would stay in L2 at small batches; at batch 1 the 24
layers' rows, 48 MB, may still fit in the H200's L2). Same bytes and roofline as above (the rows' states read
and written once): (a) moves them three times, (b) once. The ratio column is against (a).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from jax_timing import chained_seconds

from qwen35_jax.roofline import require_device_limits

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # leave room for torch when fla runs too

SWEEP = [(block_dv, warps) for block_dv in (16, 32, 64, 128) for warps in (1, 2, 4, 8)]


def make_inputs(batch, nk=16, nv=32, dk=128, dv=128):
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kg, kb, ks = jax.random.split(jax.random.PRNGKey(0), 6)
    dtype = jnp.bfloat16
    q = jax.random.normal(kq, (batch, nk, dk)).astype(dtype)
    k = jax.random.normal(kk, (batch, nk, dk)).astype(dtype)
    v = jax.random.normal(kv, (batch, nv, dv)).astype(dtype)
    g = -jnp.exp(jax.random.uniform(kg, (batch, nv), minval=-5.0, maxval=1.0))
    beta = jax.nn.sigmoid(jax.random.normal(kb, (batch, nv))).astype(dtype)
    state = 0.5 * jax.random.normal(ks, (batch, nv, dk, dv), jnp.float32)
    return q, k, v, g, beta, state


def traffic(q, v, state) -> tuple[int, int]:
    """(bytes moved, FLOPs) of one decode step: state read + written, q/k/v read once, o written, g and beta."""
    batch, nv, dk, dv = state.shape
    item = v.dtype.itemsize
    bytes_moved = (
        2 * state.size * state.dtype.itemsize + 2 * q.size * item + 2 * v.size * item + batch * nv * (4 + item)
    )
    flops = 7 * batch * nv * dk * dv  # decay, S^T k, rank-1 update (mul + add), S^T q
    return bytes_moved, flops


def device_time(step, inputs, iters: int, repeats: int) -> float:
    """Seconds a call of step(q, k, v, g, beta, state) -> (o, state), chained `iters` times in one program."""
    q, k, v, g, beta, state = inputs
    return chained_seconds(lambda _, s: step(q, k, v, g, beta, s), v, state, iters, repeats)[0]


def pool_device_time(step, inputs, pool, slots, iters: int, repeats: int):
    """(seconds a call of step(q, k, v, g, beta, pool, layer, slots) -> (o, pool), pool): `iters` calls chained
    through the donated pool in one program, call i at layer i % layers; returns the pool for the next run."""
    q, k, v, g, beta, _ = inputs
    layers = pool.shape[0]

    def call(i, pool):
        return step(q, k, v, g, beta, pool, i % layers, slots)

    return chained_seconds(call, v, pool, iters, repeats, donate=True)


def fla_time(inputs, iters: int, repeats: int) -> float | None:
    """Seconds a call of fla's fused_recurrent_gated_delta_rule, or None without torch + fla."""
    try:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    import numpy as np

    def to_torch(x, dtype):
        return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", dtype)

    q, k, v, g, beta, state = inputs
    tq, tk, tv = (to_torch(x, torch.bfloat16)[:, None] for x in (q, k, v))  # [B, T=1, heads, d]
    tg, tbeta = to_torch(g, torch.float32)[:, None], to_torch(beta, torch.bfloat16)[:, None]
    tstate = to_torch(state, torch.float32)

    def call():
        return fused_recurrent_gated_delta_rule(
            q=tq, k=tk, v=tv, g=tg, beta=tbeta, initial_state=tstate, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    from torch_timing import capture, replay_seconds

    call()
    torch.cuda.synchronize()
    return replay_seconds(capture(call, iters), iters, repeats)


RESULTS: list[dict] = []  # every printed row, for --json


def report(name: str, seconds: float, bytes_moved: int, flops: int, ref_seconds: float, fla_seconds: float | None,
           batch: int, baseline: str = "XLA ref", label: str | None = None, **extra):  # fmt: skip
    """One result row: printed (as `label`, default `name`) and kept for --json. ref_over_impl is the time of
    `baseline` (ref_seconds) over this one; extra fields go into the JSON row."""
    roofline = bytes_moved / require_device_limits().hbm_bytes_per_s
    RESULTS.append(dict(kernel="gdn_decode", batch=batch, impl=name, us=seconds * 1e6, bytes=bytes_moved,
                        flops=flops, roofline_us=roofline * 1e6, roofline_pct=100 * roofline / seconds,
                        baseline=baseline, ref_over_impl=ref_seconds / seconds,
                        fla_over_impl=None if fla_seconds is None else fla_seconds / seconds, **extra))  # fmt: skip
    line = (
        f"  {label or name:<28} {seconds * 1e6:9.2f} us  {bytes_moved / 1e6:9.2f} MB  {flops / 1e9:7.3f} GFLOP"
        f"  {100 * roofline / seconds:5.1f}% of HBM  x{ref_seconds / seconds:5.2f} vs {baseline}"
    )
    if fla_seconds is not None:
        line += f"  x{fla_seconds / seconds:5.2f} vs fla"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write every result row to this file")
    parser.add_argument("--sweep", action="store_true", help="time every (block_dv, num_warps) in SWEEP")
    parser.add_argument("--pool", action="store_true", help="gather+kernel+scatter vs the in-pool kernel (above)")
    parser.add_argument("--layers", type=int, default=24, help="--pool: layers of the pool (24 at 4B)")
    parser.add_argument("--pool-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="--pool: the states' storage (`--mamba-ssm-cache-dtype`); the math is fp32 either way")  # fmt: skip
    args = parser.parse_args()

    import jax
    import numpy as np

    from qwen35_jax.kernels import gdn_decode

    if jax.devices()[0].platform != "gpu":
        sys.exit(f"bench_gdn_decode needs a GPU; JAX runs on {jax.devices()[0].platform} (set JAX_PLATFORMS=cuda)")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16 q/k/v, fp32 state")
    default = gdn_decode.GDN_DECODE_TUNING
    configs = [gdn_decode.GdnDecodeTuning(*c) for c in SWEEP] if args.sweep else [default]
    for batch in args.batch:
        if args.pool:
            bench_pool(batch, args.layers, configs, args.sweep, args.iters, args.repeats, args.pool_dtype)
            continue
        inputs = make_inputs(batch)
        bytes_moved, flops = traffic(inputs[0], inputs[2], inputs[5])
        ref_seconds = device_time(gdn_decode.gdn_decode_ref, inputs, args.iters, args.repeats)
        fla_seconds = fla_time(inputs, args.iters, args.repeats)
        _, state = jax.jit(rows_step)(*inputs)
        _, ref_state = jax.jit(gdn_decode.gdn_decode_ref)(*inputs)
        error = float(np.max(np.abs(np.asarray(state) - np.asarray(ref_state))))
        print(f"batch {batch}: max |state - ref| {error:.2e}")
        report("XLA reference", ref_seconds, bytes_moved, flops, ref_seconds, fla_seconds, batch)
        if fla_seconds is not None:
            report("fla fused_recurrent", fla_seconds, bytes_moved, flops, ref_seconds, fla_seconds, batch)
        for tuning in configs:
            seconds = device_time(functools.partial(rows_step, tuning=tuning), inputs, args.iters, args.repeats)
            report(f"pallas dv/{tuning.block_dv} warps {tuning.num_warps}", seconds, bytes_moved, flops, ref_seconds,
                   fla_seconds, batch)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


def rows_step(q, k, v, g, beta, state, *, tuning=None):
    """The in-pool kernel on states [B, nv, dk, dv] as the one-layer pool state[None], row b in slot b (no trash slot)."""
    import jax.numpy as jnp

    from qwen35_jax.kernels.gdn_decode import GDN_DECODE_TUNING, gdn_decode_pool_pallas

    slots = jnp.arange(state.shape[0], dtype=jnp.int32)
    out, pool = gdn_decode_pool_pallas(q, k, v, g, beta, state[None], 0, slots, None,
                                       tuning=tuning or GDN_DECODE_TUNING)  # fmt: skip
    return out, pool[0]


def bench_pool(batch: int, layers: int, configs, sweep: bool, iters: int, repeats: int,
               pool_dtype: str = "float32") -> None:  # fmt: skip
    """--pool for one batch: both ways through a [layers, batch + 1, nv, dk, dv] pool, for each config."""
    import jax
    import jax.numpy as jnp

    from qwen35_jax.kernels.gdn_decode import gdn_decode_pool_pallas, gdn_decode_pool_ref

    inputs = make_inputs(batch)
    stored = inputs[5].astype(pool_dtype)
    bytes_moved, flops = traffic(inputs[0], inputs[2], stored)  # the rows' states read + written once
    nv, dk, dv = inputs[5].shape[1:]
    kp, ks = jax.random.split(jax.random.PRNGKey(1))
    shape = (layers, batch + 1, nv, dk, dv)
    pool = jax.jit(lambda key: (0.5 * jax.random.normal(key, shape, jnp.float32)).astype(pool_dtype))(kp)
    slots = jax.random.permutation(ks, batch).astype(jnp.int32)  # slot `batch`, the trash slot, stays unused
    print(f"batch {batch}, pool of {layers} layers x {batch + 1} slots ({pool.nbytes / 1e9:.1f} GB):")
    gather = gdn_decode_pool_ref
    gather_seconds, pool = pool_device_time(gather, inputs, pool, slots, iters, repeats)
    for tuning in configs:
        in_pool = functools.partial(gdn_decode_pool_pallas, tuning=tuning)
        block_dv, warps = tuning.block_dv, tuning.num_warps

        @jax.jit
        def one_step_apart(pool, in_pool=in_pool):
            """Max |difference| of the new rows and of o after one step both ways from the same pool, at layer 1
            (not donated: XLA copies the pool for each result, 3 pools at most in memory)."""
            o_a, pool_a = gather(*inputs[:5], pool, 1, slots)
            o_b, pool_b = in_pool(*inputs[:5], pool, 1, slots)
            rows = jnp.max(jnp.abs(pool_a[1, slots].astype(jnp.float32) - pool_b[1, slots].astype(jnp.float32)))
            return rows, jnp.max(jnp.abs(o_a.astype(jnp.float32) - o_b.astype(jnp.float32)))

        rows_error, out_error = (float(x) for x in one_step_apart(pool))
        print(f"  dv/{block_dv} warps {warps}: max |new rows a - b| {rows_error:.2e}, max |o a - b| {out_error:.2e}")
        pool_seconds, pool = pool_device_time(in_pool, inputs, pool, slots, iters, repeats)
        label = f"in-pool pallas dv/{block_dv} w{warps}" if sweep else "in-pool pallas"
        report("in-pool pallas", pool_seconds, bytes_moved, flops, gather_seconds, None, batch,
               baseline="XLA gather+ref+scatter", label=label, mode="pool", layers=layers, block_dv=block_dv,
               num_warps=warps, pool_dtype=pool_dtype)  # fmt: skip
    report("XLA gather+ref+scatter", gather_seconds, bytes_moved, flops, gather_seconds, None, batch,
           baseline="XLA gather+ref+scatter", mode="pool", layers=layers, pool_dtype=pool_dtype)  # fmt: skip


if __name__ == "__main__":
    main()
