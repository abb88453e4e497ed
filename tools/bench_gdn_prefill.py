"""Micro-benchmark of the GDN chunked prefill (GPU only): the Pallas kernel against the jitted XLA reference and, when
flash-linear-attention is importable, its Triton `chunk_gated_delta_rule`, at 4B shapes (nk 16, nv 32, dk = dv = 128).

    JAX_PLATFORMS=cuda python tools/bench_gdn_prefill.py --tokens 1024 2048 4096 8192 --rows 1 4 --block-v 32 64

Per case and kernel tiling (every combination of the tile flags, each passed to the kernel as a `GdnPrefillTuning`;
a flag left at 0 keeps the measured default, `gdn_prefill_tuning`) it prints the time of one call (mean over --iters
back-to-back calls, best of --repeats), the matmul FLOPs of the chunked algorithm and their rate against the card's bf16
matrix rate, the minimal HBM traffic (inputs, outputs and states once) against its HBM bandwidth (790 TFLOP/s and
4.3 TB/s on the H200, qwen35_jax/roofline.py), the share of the roofline max(FLOPs / rate, bytes / bandwidth) reached, and the ratio of the reference's and fla's times to the kernel's (> 1: the
kernel is faster); also the size of the fp32 Q_c S_c the walk hands the output pass (not counted in the minimal
traffic). fla is timed replaying a CUDA graph of --iters calls (its host-loop time is kept as
`fla_host_loop_ms`), so its Python launch overhead is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

from jax_timing import best_seconds

from qwen35_jax.roofline import require_device_limits
from qwen35_jax.serving.offline_bench import save_json

CHUNK = 64
TILE_FLAGS = {  # GdnPrefillTuning's fields, each a flag taking several values
    "block_v": "dv slice of the chunk-state walk",
    "num_warps": "warps of the chunk-state walk",
    "num_stages": "pipelining stages of the chunk-state walk",
    "prep_warps": "warps of the WY kernel",
    "output_block_v": "dv slice of the output kernel",
    "output_warps": "warps of the output kernel",
    "output_block_k": "dk slice of the output kernel's product loop",
    "output_stages": "pipelining stages of the output kernel's product loop",
}


def chunked_flops(rows: int, tokens: int, nv: int, dk: int, dv: int) -> float:
    """Matmul FLOPs of the chunked algorithm (2 per multiply-add; the 64x64 triangular solve left out):
    per chunk and value head K K^T, W, U, Q K^T and the intra-chunk A V' (C^2 d each) plus W S, Q S and K^T V' (C dk dv)."""
    chunks = rows * nv * -(-tokens // CHUNK)
    per_chunk = CHUNK * CHUNK * (3 * dk + 2 * dv) + 3 * CHUNK * dk * dv
    return 2.0 * chunks * per_chunk


def minimal_bytes(rows: int, tokens: int, nk: int, nv: int, dk: int, dv: int, itemsize: int) -> float:
    """q, k, v, beta read and o written once in the model dtype, g fp32, states read and written once in fp32."""
    per_token = (2 * nk * dk + 2 * nv * dv + nv) * itemsize + 4 * nv
    return rows * tokens * per_token + 2 * rows * nv * dk * dv * 4


def q_states_bytes(rows: int, tokens: int, nv: int, dv: int) -> float:
    """Q_c S_c, fp32 [T, dv] a value head (T padded to whole chunks), which the walk hands the output pass."""
    return rows * nv * -(-tokens // CHUNK) * CHUNK * dv * 4


def time_calls(fn, args, iters: int, repeats: int, sync) -> float:
    """Seconds per call: `iters` calls back to back (dispatch overlaps the device), best of `repeats`."""
    sync(fn(*args))

    def run():
        for _ in range(iters):
            out = fn(*args)
        sync(out)

    return best_seconds(run, repeats) / iters


def make_inputs(rows, tokens, nk, nv, dk, dv, dtype):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (rows, tokens, nk, dk)).astype(dtype)
    k = jax.random.normal(keys[1], (rows, tokens, nk, dk)).astype(dtype)
    v = jax.random.normal(keys[2], (rows, tokens, nv, dv)).astype(dtype)
    g = -jnp.exp(jnp.linspace(-4.0, 1.0, nv)) * jax.nn.softplus(jax.random.normal(keys[3], (rows, tokens, nv)) - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (rows, tokens, nv))).astype(dtype)
    state = 0.3 * jax.random.normal(keys[5], (rows, nv, dk, dv))
    return q, k, v, g, beta, state, jnp.full((rows,), tokens, jnp.int32)


def fla_runner(inputs, ratio: int):
    """A callable running fla's chunk_gated_delta_rule on the same data (q/k repeated to the value heads beforehand,
    as HF does), or None when fla or torch is missing."""
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    q, k, v, g, beta, state = (torch.from_dlpack(x) for x in inputs[:6])
    q, k = (x.repeat_interleave(ratio, dim=2).contiguous() for x in (q, k))

    def run():
        return chunk_gated_delta_rule(
            q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    return run, torch.cuda.synchronize


def fla_graph_ms(run, iters: int, repeats: int) -> float | None:
    """Milliseconds a call of fla replayed from one CUDA graph of `iters` calls, or None if it cannot be captured."""
    from torch_timing import capture, replay_seconds

    try:
        graph = capture(run, iters)
    except Exception as error:  # capture fails if fla syncs with the host inside (not expected without cu_seqlens)
        print(f"fla: no CUDA graph ({type(error).__name__}: {error}); host-loop time kept")
        return None
    return 1e3 * replay_seconds(graph, iters, repeats)


def kernel_stages(kernel, inputs, iters: int, trace_dir: str) -> dict[str, float]:
    """Device milliseconds per call of each kernel the program runs (a jax.profiler trace of `iters` calls)."""
    import jax
    from device_trace import time_by_name, trace_events

    jax.block_until_ready(kernel(*inputs))
    jax.profiler.start_trace(trace_dir)
    for _ in range(iters):
        out = kernel(*inputs)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    return time_by_name(trace_events(trace_dir)[0], iters, top=12)


def fla_stages(run, iters: int) -> dict[str, float]:
    """The same for fla, from torch.profiler's CUDA kernel events."""
    import torch
    from device_trace import time_by_name

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    kernels = [{"name": e.name, "dur": e.time_range.elapsed_us()} for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    return time_by_name(kernels, iters, top=12)


def bench_case(args, rows: int, tokens: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from qwen35_jax.kernels.gdn_prefill import gdn_chunked_prefill_pallas, gdn_chunked_prefill_ref, gdn_prefill_tuning

    dtype = jnp.dtype(args.dtype)
    inputs = make_inputs(rows, tokens, args.nk, args.nv, args.dk, args.dv, dtype)
    flops = chunked_flops(rows, tokens, args.nv, args.dk, args.dv)
    nbytes = minimal_bytes(rows, tokens, args.nk, args.nv, args.dk, args.dv, dtype.itemsize)
    peak_bytes, peak_flops = require_device_limits()
    roofline = max(flops / peak_flops, nbytes / peak_bytes)
    timing = functools.partial(time_calls, iters=args.iters, repeats=args.repeats, sync=jax.block_until_ready)
    result = {"rows": rows, "tokens": tokens, "dtype": args.dtype, "gflop": flops / 1e9, "mbytes": nbytes / 1e6}
    result["ref_ms"] = 1e3 * timing(jax.jit(gdn_chunked_prefill_ref), inputs)
    out_ref, _ = jax.jit(gdn_chunked_prefill_ref)(*inputs)
    default = gdn_prefill_tuning(rows, args.nv, args.dv)
    q_states = q_states_bytes(rows, tokens, args.nv, args.dv)
    for values in itertools.product(*(getattr(args, name) for name in TILE_FLAGS)):
        given = {name: value for name, value in zip(TILE_FLAGS, values, strict=True) if value}
        tuning = dataclasses.replace(default, **given)
        kernel = jax.jit(functools.partial(gdn_chunked_prefill_pallas, tuning=tuning))
        name = "pallas " + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(tuning).items())
        try:
            seconds = timing(kernel, inputs)
        except jax.errors.JaxRuntimeError as error:  # a tiling over the shared memory: skipped, the sweep goes on
            print(f"  {name}: failed: {str(error).splitlines()[0]}", flush=True)
            continue
        out, _ = kernel(*inputs)
        error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - out_ref.astype(jnp.float32))))
        stages = kernel_stages(kernel, inputs, args.iters, args.profile) if args.profile else None
        result[name] = {
            "kernel_ms_per_call": stages,
            "tuning": dataclasses.asdict(tuning),
            "ms": 1e3 * seconds,
            "tflops": flops / seconds / 1e12,
            "pct_peak_flops": 100 * flops / seconds / peak_flops,
            "pct_peak_bytes": 100 * nbytes / seconds / peak_bytes,
            "pct_roofline": 100 * roofline / seconds,
            "ref_over_kernel": result["ref_ms"] / (1e3 * seconds),
            "max_abs_err_vs_ref": error,
            "q_states_mbytes": q_states / 1e6,
        }
    fla = None if args.no_fla else fla_runner(inputs, args.nv // args.nk)
    if fla is not None:
        run, sync = fla
        run()  # Triton autotuning and compilation happen on the first call
        sync()
        result["fla_ms"] = 1e3 * time_calls(lambda: run(), (), args.iters, args.repeats, lambda _: sync())
        graph_ms = fla_graph_ms(run, args.iters, args.repeats)
        if graph_ms is not None:  # fla launches several kernels from Python; the graph removes that host time
            result["fla_host_loop_ms"], result["fla_ms"] = result["fla_ms"], graph_ms
        if args.profile_fla:
            result["fla_kernel_ms_per_call"] = fla_stages(run, args.iters)
        out_fla = run()[0].float().cpu().numpy()
        result["fla_max_abs_err_vs_ref"] = float(np.abs(out_fla - np.asarray(out_ref, np.float32)).max())
    return result


def report(result: dict) -> str:
    lines = [
        f"rows {result['rows']} x {result['tokens']} tokens {result['dtype']}: {result['gflop']:.1f} GFLOP, "
        f"{result['mbytes']:.0f} MB; XLA ref {result['ref_ms']:.3f} ms"
        + (f"; fla {result['fla_ms']:.3f} ms" if "fla_ms" in result else "; fla not importable")
    ]
    for key, r in result.items():
        if key.startswith("pallas "):
            vs_fla = f", fla/kernel {result['fla_ms'] / r['ms']:.2f}x" if "fla_ms" in result else ""
            lines.append(
                f"  {key}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s ({r['pct_peak_flops']:.1f}% of "
                f"peak), {r['pct_peak_bytes']:.1f}% of HBM, {r['pct_roofline']:.1f}% of roofline, "
                f"ref/kernel {r['ref_over_kernel']:.2f}x{vs_fla}, max |err| {r['max_abs_err_vs_ref']:.2e}"
                + f", Q S handed over {r['q_states_mbytes']:.0f} MB"
            )
            lines += [f"    {ms:.4f} ms  {name}" for name, ms in (r["kernel_ms_per_call"] or {}).items()]
    if "fla_kernel_ms_per_call" in result:
        lines += [f"  fla kernel {ms:.4f} ms  {name}" for name, ms in result["fla_kernel_ms_per_call"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="tokens per row")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="request rows per call")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--nk", type=int, default=16)
    parser.add_argument("--nv", type=int, default=32)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    for name, what in TILE_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="+", default=[0], help=f"{what}; 0: default")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--profile", default=None, help="trace dir: also report device time per kernel and call")
    parser.add_argument("--profile-fla", action="store_true",
                        help="also fla's kernels (torch.profiler); CUPTI takes one profiler per process, so after it "
                             "JAX's profiler fails: use it alone, in a process without --profile")  # fmt: skip
    parser.add_argument("--no-fla", action="store_true",
                        help="skip fla (its first call per shape autotunes every kernel: tens of seconds at 8k)")  # fmt: skip
    args = parser.parse_args()
    if args.profile and args.profile_fla:
        parser.error("--profile and --profile-fla need separate processes (one CUPTI subscriber per process)")

    import jax

    if jax.devices()[0].platform != "gpu":
        raise SystemExit(f"needs a GPU (JAX runs on {jax.devices()[0].platform}); set JAX_PLATFORMS=cuda")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    results = []
    for rows in args.rows:
        for tokens in args.tokens:
            results.append(bench_case(args, rows, tokens))
            print(report(results[-1]), flush=True)
            save_json(args.json, results)


if __name__ == "__main__":
    main()
