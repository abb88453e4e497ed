"""Micro-benchmark of the attention kernels on the GPU: the Pallas decode kernel and the prefill attention (the chunk
part on tokamax's kernel, then the Triton prefix pass: `kernels/chunk_attention.py`) against their jitted XLA
references, each next to its roofline (decode: bytes moved / HBM bandwidth; prefill: FLOPs / the bf16 matrix rate; the card's measured limits,
qwen35_jax/roofline.py).

    python tools/bench_attention.py                                   # both kernels, 4B heads, default cases
    python tools/bench_attention.py --kernel decode --batch 1 8 64 --context 1024 4096 --sweep
    python tools/bench_attention.py --kernel prefill --chunk 512 --prefix 4096 --sweep
    python tools/bench_attention.py --interpret                       # CPU logic check, tiny shapes
    python tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --dense-baselines

Every row: its case; the kernel's time per call, its useful bytes and FLOPs, the roofline time and the kernel's
share of it (% of roofline = roofline time / measured time); the reference's time and the speed ratio
(reference time / kernel time). Decode rows hold `context` cached tokens each; prefill rows a chunk of
`chunk` tokens after `prefix` cached ones. Each timed call runs the op `repeats` times back to back inside
one jitted program, each call's output feeding the next call's query, on a different layer of a pool of at
least 256 MiB so that the 50 MB L2 holds no previous call's K/V; times include the launch gaps between those
kernels. The page-table width is `--max-model-len` / page_size, as the engine sizes it: the reference gathers
the whole width, the kernel only the pages a row uses.

`--sweep` also times the tuning grid, each entry passed to the kernel as its tuning value (`DecodeAttentionTuning`,
the prefix pass's `PrefixTuning`; the fields an entry leaves out keep the measured defaults for the dtype), and
prints the best per case. The prefix pass only runs for rows with a prefix, so sweep it with --prefix > 0. Each
result row (JSON) holds `config` (the sweep entry) and `tuning` (every field the kernel ran with).

`--dense-baselines` (prefill cases with prefix 0): also times library kernels on the same causal problem with
contiguous, unpaged q/k/v [rows, chunk, heads, dim]: JAX's Mosaic GPU flash attention for Hopper
(`jax.experimental.pallas.ops.gpu.attention_mgpu`: TMA, wgmma, a producer warpgroup; GQA native), JAX's Triton
flash attention (`...ops.gpu.attention.mha`; K/V repeated to every query head, since it has no GQA) and, when
tokamax is importable, its Mosaic GPU sm90 kernel at each `TOKAMAX_SWEEP` config (the chunk part's kernel) and its
Triton kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import numpy as np
from jax_timing import best_seconds

from qwen35_jax.roofline import require_device_limits
from qwen35_jax.serving.offline_bench import save_json

MIN_POOL_BYTES = 256 * 2**20

DECODE_SWEEP = [dict(block_k=bk, num_warps=w, num_stages=s) for bk, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]  # fmt: skip
PREFILL_SWEEP = [dict(tile_rows=r, block_k=bk, num_warps=w, num_stages=s)
                 for r, bk, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))]  # fmt: skip


def make_inputs(rng, lengths, heads, kv_heads, dim, page_size, width, dtype, queries, min_pool_bytes):
    """q [R, H, D] (queries None) or [R, queries, H, D]; pools sized to the rows' pages with at least
    min_pool_bytes over all layers; page tables of shuffled pages. Returns (q, k, v, table, layers)."""
    import jax.numpy as jnp

    pages_per_row = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_row) + 1
    layer_bytes = num_pages * page_size * kv_heads * dim * jnp.dtype(dtype).itemsize * 2
    layers = max(1, min(64, -(-min_pool_bytes // layer_bytes)))
    ids = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(lengths), width), np.int32)
    for row, count in enumerate(pages_per_row):
        table[row, :count] = ids[sum(pages_per_row[:row]) : sum(pages_per_row[: row + 1])]
    shape = (layers, num_pages, page_size, kv_heads, dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q_shape = (len(lengths), heads, dim) if queries is None else (len(lengths), queries, heads, dim)
    q = jnp.asarray(rng.standard_normal(q_shape, np.float32), dtype)
    return q, k, v, jnp.asarray(table), layers


def seconds_per_call(op, args, layers: int, repeats: int, trials: int) -> float:
    """Best of `trials` wall times of one program that runs op `repeats` times on layers 0, 1, ... (mod layers)."""
    import jax
    import jax.numpy as jnp

    def program(q, k, v, *rest):
        # Each call's output is the next call's query: without that dependency XLA merges calls with equal
        # operands (same layer) into one, and a pool of fewer layers than repeats would time a fraction.
        for i in range(repeats):
            q = op(q, k, v, jnp.int32(i % layers), *rest).astype(q.dtype).reshape(q.shape)
        return q

    compiled = jax.jit(program)
    for _ in range(2):  # the first call in a process can change JAX's tracing context and retrace once
        jax.block_until_ready(compiled(*args))
    return best_seconds(lambda: jax.block_until_ready(compiled(*args)), trials) / repeats


def decode_work(lengths, heads, kv_heads, dim, page_size, itemsize) -> tuple[float, float]:
    """(bytes, FLOPs) a decode call must move and compute: each cached K/V once, q, o and the used page ids."""
    tokens = float(sum(lengths))
    kv = tokens * kv_heads * dim * 2 * itemsize
    q_and_o = len(lengths) * heads * dim * 2 * itemsize
    page_ids = sum(-(-n // page_size) for n in lengths) * 4
    return kv + q_and_o + page_ids, 4.0 * tokens * heads * dim


def prefill_work(starts, lengths, chunk, heads, kv_heads, dim, itemsize) -> tuple[float, float]:
    """(bytes, FLOPs) of a prefill call: each row's cached K/V once plus q and o; QK^T and PV over the causal
    keys of each valid query (4 FLOPs per query, key, head and dim)."""
    keys = sum(n * s + n * (n + 1) / 2 for s, n in zip(starts, lengths, strict=True))
    kv = sum(s + n for s, n in zip(starts, lengths, strict=True)) * kv_heads * dim * 2 * itemsize
    q_and_o = len(lengths) * chunk * heads * dim * 2 * itemsize
    return kv + q_and_o, 4.0 * keys * heads * dim


def roofline_seconds(bytes_moved: float, flops: float) -> float:
    limits = require_device_limits()
    return max(bytes_moved / limits.hbm_bytes_per_s, flops / limits.bf16_flops_per_s)


def bench_case(kind: str, case: dict, shape: dict, args, configs: list[dict]) -> list[dict]:
    """Time the reference and the kernel at every tuning of `configs` (each entry's fields replaced into the
    measured defaults for the dtype) for one case; one result row per configuration."""
    import jax.numpy as jnp

    from qwen35_jax.kernels.chunk_attention import prefill_attention_pallas, prefill_attention_ref, prefix_tuning
    from qwen35_jax.kernels.decode_attention import (
        decode_attention_tuning,
        paged_decode_attention_pallas,
        paged_decode_attention_ref,
    )

    rng = np.random.default_rng(0)
    dtype, itemsize = jnp.dtype(args.dtype), jnp.dtype(args.dtype).itemsize
    heads, kv_heads, dim, page_size = shape["heads"], shape["kv_heads"], shape["dim"], args.page_size
    width = -(-args.max_model_len // page_size)
    pool = 0 if args.interpret else MIN_POOL_BYTES
    if kind == "decode":
        lengths = [case["context"]] * case["batch"]
        q, k, v, table, layers = make_inputs(rng, lengths, heads, kv_heads, dim, page_size, width, dtype, None, pool)
        rest = (table, jnp.asarray(lengths, jnp.int32))
        work = decode_work(lengths, heads, kv_heads, dim, page_size, itemsize)
        ref, kernel, default = paged_decode_attention_ref, paged_decode_attention_pallas, decode_attention_tuning(dtype)
    else:
        starts, lengths = [case["prefix"]] * case["rows"], [case["chunk"]] * case["rows"]
        ends = [s + n for s, n in zip(starts, lengths, strict=True)]
        q, k, v, table, layers = make_inputs(
            rng, ends, heads, kv_heads, dim, page_size, width, dtype, case["chunk"], pool
        )
        # The chunk's own k, v (random: the timing does not depend on them), after the page operands.
        chunk_kv = [jnp.asarray(rng.standard_normal((*q.shape[:2], kv_heads, dim), np.float32), dtype)
                    for _ in range(2)]  # fmt: skip
        rest = (table, jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32), *chunk_kv)
        work = prefill_work(starts, lengths, case["chunk"], heads, kv_heads, dim, itemsize)
        ref, kernel, default = (
            chunk_first(prefill_attention_ref),
            chunk_first(prefill_attention_pallas),
            prefix_tuning(dtype),
        )
    timing = dict(layers=layers, repeats=args.repeats, trials=args.trials)
    operands = (q, k, v, *rest)
    ref_s = seconds_per_call(ref, operands, **timing)
    rows = []
    for config in configs:
        tuning = dataclasses.replace(default, **config)
        op = lambda *a, tuning=tuning: kernel(*a, interpret=args.interpret, tuning=tuning)  # noqa: E731
        try:
            kernel_s = seconds_per_call(op, operands, **timing)
        except Exception as error:  # a configuration that does not compile (shared memory, registers)
            rows.append(dict(kind=kind, **case, config=config, error=f"{type(error).__name__}: {error}"[:200],
                             tuning=dataclasses.asdict(tuning)))  # fmt: skip
            continue
        rows.append(timed_row(kind, case, config, kernel_s, work, ref_s, tuning=dataclasses.asdict(tuning)))
    return rows


def chunk_first(prefill):
    """A prefill attention (q, k, v, k_pages, v_pages, layer, table, start, lengths) called with the page operands
    first, as `seconds_per_call` passes them (q, k_pages, v_pages, layer, table, start, lengths, k, v)."""

    def op(q, k_pages, v_pages, layer, table, start, lengths, k, v, **options):
        return prefill(q, k, v, k_pages, v_pages, layer, table, start, lengths, **options)

    return op


def timed_row(kind: str, case: dict, config: dict, seconds: float, work, ref_s: float | None = None, **extra) -> dict:
    """A result row: the case, its time per call beside the roofline of `work` (bytes, FLOPs) and, given the
    reference's time, the speed ratio; extra keys (impl, options) as given."""
    roof = roofline_seconds(*work)
    row = dict(kind=kind, **case, config=config, kernel_us=seconds * 1e6, bytes=work[0], flops=work[1],
               roofline_us=roof * 1e6, roofline_pct=100 * roof / seconds, **extra)  # fmt: skip
    if ref_s is not None:
        row.update(ref_us=ref_s * 1e6, speedup=ref_s / seconds)
    return row


MGPU_SWEEP = [dict(block_q=64, block_kv=bk, max_concurrent_steps=s) for bk, s in ((64, 2), (64, 3), (128, 2))]
# tokamax's Mosaic GPU (sm90) flash attention (`TokamaxConfig`): block_q rows per compute warpgroup (two of them),
# block_kv keys a TMA stage; at head_dim 256 the q tile and two stages of K and V fill ~192 KiB of shared memory at
# block_kv 64.
TOKAMAX_SWEEP = [dict(block_q=bq, block_kv=bk, num_stages=s) for bq, bk, s in ((64, 64, 2), (64, 64, 3), (64, 128, 2))]


def tokamax_candidates(dim: int) -> list[tuple]:
    """(name, config, op) for tokamax's Mosaic GPU and Triton flash attention, or none when tokamax is absent."""
    from qwen35_jax.kernels.chunk_attention import TokamaxConfig, tokamax_attention

    try:
        from tokamax._src.ops.attention import pallas_triton
    except ImportError as error:
        print(f"tokamax not importable ({error}); its baselines are skipped")
        return []

    def mosaic(config):
        attention = tokamax_attention(TokamaxConfig(**config))
        return lambda q, k, v: attention(q, k, v, is_causal=True)

    triton = pallas_triton.PallasTritonFlashAttention()
    return [("tokamax_mosaic", c, mosaic(c)) for c in TOKAMAX_SWEEP] + [
        ("tokamax_triton", {}, lambda q, k, v: triton(q, k, v, is_causal=True))
    ]


def dense_baseline_rows(case: dict, shape: dict, args) -> list[dict]:
    """Time the library flash kernels on the dense causal problem of a prefix-0 prefill case."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention as triton_attention
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    heads, kv_heads, dim, rows, chunk = shape["heads"], shape["kv_heads"], shape["dim"], case["rows"], case["chunk"]
    dtype, key = jnp.dtype(args.dtype), jax.random.key(0)
    q = jax.random.normal(key, (rows, chunk, heads, dim), dtype)
    kv = [jax.random.normal(jax.random.fold_in(key, i), (rows, chunk, kv_heads, dim), dtype) for i in (1, 2)]
    work = prefill_work([0] * rows, [chunk] * rows, chunk, heads, kv_heads, dim, dtype.itemsize)
    candidates = [("mgpu", c, lambda q, k, v, c=c: attention_mgpu.attention(
        q, k, v, attention_mgpu.TuningConfig(causal=True, **c))) for c in MGPU_SWEEP]  # fmt: skip
    group = heads // kv_heads
    candidates.append(("triton_mha", {}, lambda q, k, v: triton_attention.mha(
        q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), None, sm_scale=dim**-0.5, causal=True)))  # fmt: skip
    candidates += tokamax_candidates(dim)
    out = []
    for name, config, op in candidates:

        def program(q, k, v, op=op):
            for _ in range(args.repeats):  # chained through q, as in seconds_per_call
                q = op(q, k, v).astype(q.dtype)
            return q

        compiled = jax.jit(program)
        try:
            for _ in range(2):
                jax.block_until_ready(compiled(q, *kv))
        except Exception as error:
            out.append(
                dict(kind="dense", impl=name, **case, config=config, error=f"{type(error).__name__}: {error}"[:300])
            )
            continue
        seconds = best_seconds(lambda c=compiled: jax.block_until_ready(c(q, *kv)), args.trials) / args.repeats
        out.append(timed_row("dense", case, config, seconds, work, impl=name))
    return out


def format_row(row: dict) -> str:
    case = {k: v for k, v in row.items() if k in ("batch", "context", "rows", "chunk", "prefix")}
    label = " ".join(f"{k}={v}" for k, v in case.items())
    config = " ".join(f"{k}={v}" for k, v in row["config"].items()) or "defaults"
    if "impl" in row:
        config = f"{row['impl']} {config}"
    if "error" in row:
        return f"{row['kind']:8s} {label:34s} {config:52s} FAILED {row['error']}"
    line = (f"{row['kind']:8s} {label:34s} {config:52s} {row['kernel_us']:9.1f} us {row['bytes'] / 1e6:9.1f} MB "
            f"{row['flops'] / 1e9:9.2f} GFLOP {row['roofline_us']:8.1f} us {row['roofline_pct']:5.1f}%")  # fmt: skip
    if "ref_us" in row:  # the dense library baselines have no reference time
        line += f" ref {row['ref_us']:9.1f} us  x{row['speedup']:.2f}"
    return line


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("decode", "prefill", "both"), default="both")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64], help="decode rows")
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096], help="decode cached tokens per row")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="prefill rows")
    parser.add_argument("--chunk", type=int, nargs="+", default=[128, 512, 1024], help="prefill chunk tokens")
    parser.add_argument("--prefix", type=int, nargs="+", default=[0, 4096], help="prefill cached tokens before")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None, help="page-table width x page size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20, help="calls per timed program")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time the tuning grid")
    parser.add_argument("--dense-baselines", action="store_true", help="also time JAX's dense flash kernels (above)")
    parser.add_argument("--interpret", action="store_true", help="CPU logic check at tiny shapes (times mean nothing)")
    parser.add_argument("--json", default=None, help="write every result row here")
    args = parser.parse_args(argv)
    if args.interpret:
        args.batch, args.context, args.rows, args.chunk, args.prefix = [2], [40], [2], [16], [0, 21]
        args.heads, args.kv_heads, args.head_dim, args.repeats, args.trials = 4, 2, 32, 1, 1
    longest = max(max(args.context), max(args.chunk) + max(args.prefix))
    args.max_model_len = args.max_model_len or longest
    return args


def main(argv=None) -> int:
    import jax

    args = parse_args(argv)
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.interpret:
        print(f"GPU only: JAX runs on {device.platform}; pass --interpret for a CPU logic check", file=sys.stderr)
        return 2
    print(f"# {' '.join(sys.argv)}\n# {device.device_kind}, jax {jax.__version__}, {args.dtype}, heads "
          f"{args.heads}/{args.kv_heads} x {args.head_dim}, page size {args.page_size}, width "
          f"{-(-args.max_model_len // args.page_size)} pages")  # fmt: skip
    shape = dict(heads=args.heads, kv_heads=args.kv_heads, dim=args.head_dim)
    cases = []
    if args.kernel in ("decode", "both"):
        cases += [("decode", dict(batch=b, context=c)) for b in args.batch for c in args.context]
    if args.kernel in ("prefill", "both"):
        cases += [("prefill", dict(rows=r, chunk=t, prefix=s)) for r in args.rows for t in args.chunk for s in args.prefix]  # fmt: skip
    results = []
    for kind, case in cases:
        configs = [{}] + ((DECODE_SWEEP if kind == "decode" else PREFILL_SWEEP) if args.sweep else [])
        rows = bench_case(kind, case, shape, args, configs)
        results += rows
        for row in rows:
            print(format_row(row), flush=True)
        timed = [r for r in rows if "error" not in r]
        if args.sweep and timed:
            print("  best:", format_row(min(timed, key=lambda r: r["kernel_us"])), flush=True)
        if args.dense_baselines and kind == "prefill" and case["prefix"] == 0 and not args.interpret:
            for row in dense_baseline_rows(case, shape, args):
                results.append(row)
                print(format_row(row), flush=True)
        save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
