"""Micro-benchmark of the causal conv1d + SiLU kernels on one GPU at Qwen3.5-4B shapes (C = 8192, K = 4, bf16):
the Pallas one-token update (in the slot pool) and ragged prefill against their jitted XLA references.

    JAX_PLATFORMS=cuda python tools/bench_conv1d.py --batch 1 8 64 256 --prefill 1x2048 4x512 16x128
    JAX_PLATFORMS=cuda python tools/bench_conv1d.py --sweep    # every block size / warp count in the sweeps

Each configuration is passed to the kernel as its tuning value (`ConvUpdateTuning`, `ConvPrefillTuning`). Time is
device time a call: `iters` calls chained in one jitted loop (the conv state carried, as in serving), the best of
`--repeats` runs, so host dispatch is not counted. The update runs on a one-layer pool whose slots are the batch's
rows in order (`causal_conv1d_update_pool_pallas`), against the XLA reference on the gathered states. Both kernels are memory bound (2K FLOPs per
element); the roofline is bytes moved / the card's HBM bandwidth (4.3 TB/s on the H200): x read and y written once, the conv state read and
written once, the weight read once. Prefill rows are ragged (lengths T, 3T/4, T/2, T/4, repeating), but y is
computed for every token, as the reference does, so the bytes count all of them.
"""

from __future__ import annotations

import argparse
import json
import sys

from jax_timing import chained_seconds

from qwen35_jax.roofline import require_device_limits

CHANNELS, TAPS = 8192, 4
UPDATE_SWEEP = [(block_c, warps) for block_c in (256, 512, 1024, 2048) for warps in (1, 2, 4, 8)]
PREFILL_SWEEP = [
    (block_t, block_c, warps) for block_t in (8, 16, 32) for block_c in (128, 256, 512) for warps in (4, 8)
]


def device_time(step, args: tuple, iters: int, repeats: int) -> float:
    """Seconds a call of step(*args) -> (y, conv_state), chained `iters` times with the state fed back."""
    *head, state = args[:3]
    tail = args[3:]
    return chained_seconds(lambda _, conv: step(*head, conv, *tail), head[0], state, iters, repeats)[0]


RESULTS: list[dict] = []  # every printed row, for --json
CASE: dict = {}  # the case the rows being printed belong to


def report(name: str, seconds: float, bytes_moved: int, flops: int, ref_seconds: float) -> None:
    roofline = bytes_moved / require_device_limits().hbm_bytes_per_s
    RESULTS.append(dict(kernel="conv1d", **CASE, impl=name, us=seconds * 1e6, bytes=bytes_moved, flops=flops,
                        roofline_us=roofline * 1e6, roofline_pct=100 * roofline / seconds,
                        ref_over_impl=ref_seconds / seconds))  # fmt: skip
    print(
        f"  {name:<34} {seconds * 1e6:9.2f} us  {bytes_moved / 1e6:8.2f} MB  {flops / 1e9:7.3f} GFLOP"
        f"  {100 * roofline / seconds:5.1f}% of HBM  x{ref_seconds / seconds:5.2f} vs XLA ref"
    )


def traffic(x, conv_state, weight) -> tuple[int, int]:
    """(bytes moved, FLOPs) of one call: x read, y written, conv state read and written, weight read."""
    item = x.dtype.itemsize
    return 2 * x.size * item + 2 * conv_state.size * item + weight.size * item, 2 * TAPS * x.size


def inputs(lead: tuple[int, ...], key: int = 0):
    import jax
    import jax.numpy as jnp

    kx, kw, ks = jax.random.split(jax.random.PRNGKey(key), 3)
    x = jax.random.normal(kx, (*lead, CHANNELS)).astype(jnp.bfloat16)
    weight = (0.5 * jax.random.normal(kw, (CHANNELS, TAPS))).astype(jnp.bfloat16)
    state = jax.random.normal(ks, (lead[0], TAPS - 1, CHANNELS)).astype(jnp.bfloat16)
    return x, weight, state


def bench_update(batch: int, sweep: bool, iters: int, repeats: int) -> None:
    import jax.numpy as jnp

    from qwen35_jax.kernels import conv1d

    args = inputs((batch,))
    bytes_moved, flops = traffic(args[0], args[2], args[1])
    ref_seconds = device_time(conv1d.causal_conv1d_update_ref, args, iters, repeats)
    CASE.clear()
    CASE.update(mode="update", batch=batch)
    print(f"update, batch {batch}")
    report("XLA reference", ref_seconds, bytes_moved, flops, ref_seconds)
    slots = jnp.arange(batch, dtype=jnp.int32)
    default = conv1d.CONV_UPDATE_TUNING
    for block_c, warps in UPDATE_SWEEP if sweep else [(default.block_c, default.num_warps)]:
        tuning = conv1d.ConvUpdateTuning(block_c=block_c, num_warps=warps)

        def step(x, weight, state, tuning=tuning):
            y, pool = conv1d.causal_conv1d_update_pool_pallas(x, weight, state[None], 0, slots, tuning=tuning)
            return y, pool[0]

        seconds = device_time(step, args, iters, repeats)
        report(f"pallas c/{block_c} warps {warps}", seconds, bytes_moved, flops, ref_seconds)


def bench_prefill(rows: int, seq: int, sweep: bool, iters: int, repeats: int) -> None:
    import jax.numpy as jnp

    from qwen35_jax.kernels import conv1d

    x, weight, state = inputs((rows, seq))
    lengths = jnp.array([seq * (4 - i % 4) // 4 for i in range(rows)], jnp.int32)
    args = (x, weight, state, lengths)
    bytes_moved, flops = traffic(x, state, weight)
    ref_seconds = device_time(conv1d.causal_conv1d_prefill_ref, args, iters, repeats)
    CASE.clear()
    CASE.update(mode="prefill", rows=rows, tokens=seq)
    print(f"prefill, {rows} rows x {seq} tokens")
    report("XLA reference", ref_seconds, bytes_moved, flops, ref_seconds)
    default = conv1d.CONV_PREFILL_TUNING
    for block_t, block_c, warps in PREFILL_SWEEP if sweep else [(default.block_t, default.block_c, default.num_warps)]:
        tuning = conv1d.ConvPrefillTuning(block_t=block_t, block_c=block_c, num_warps=warps)

        def step(*xs, tuning=tuning):
            return conv1d.causal_conv1d_prefill_pallas(*xs, tuning=tuning)

        seconds = device_time(step, args, iters, repeats)
        report(f"pallas t/{block_t} c/{block_c} warps {warps}", seconds, bytes_moved, flops, ref_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 64, 256], help="update batch sizes")
    parser.add_argument("--prefill", nargs="*", default=["1x2048", "4x512", "16x128"], help="ROWSxTOKENS")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write every result row to this file")
    parser.add_argument("--sweep", action="store_true", help="time every block size / warp count in the sweeps")
    args = parser.parse_args()

    import jax

    if jax.devices()[0].platform != "gpu":
        sys.exit(f"bench_conv1d needs a GPU; JAX runs on {jax.devices()[0].platform} (set JAX_PLATFORMS=cuda)")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, C = {CHANNELS}, K = {TAPS}")
    for batch in args.batch:
        bench_update(batch, args.sweep, args.iters, args.repeats)
    for shape in args.prefill:
        rows, seq = (int(n) for n in shape.split("x"))
        bench_prefill(rows, seq, args.sweep, args.iters, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
