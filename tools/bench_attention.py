"""Micro-benchmark of the paged attention kernels on the GPU: the Pallas kernel against the jitted XLA
reference, each next to its roofline (decode: bytes moved / 4.3 TB/s; prefill: FLOPs / 790 TFLOP/s bf16).

    python tools/bench_attention.py                                   # both kernels, 4B heads, default cases
    python tools/bench_attention.py --kernel decode --batch 1 8 64 --context 1024 4096
    python tools/bench_attention.py --kernel prefill --chunk 512 --prefix 0 4096 --sweep
    python tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --sweep --prefill-grid softmax
    python tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --exp2 off --lazy-rescale on
    python tools/bench_attention.py --interpret                       # CPU logic check, tiny shapes
    python tools/bench_attention.py --kernel prefill --chunk 8192 --prefix 0 --dense-baselines

Every row: its case; the kernel's time per call, its useful bytes and FLOPs, the roofline time and the kernel's
share of it (% of roofline = roofline time / measured time); the reference's time and the speed ratio
(reference time / kernel time). Decode rows hold `context` cached tokens each; prefill rows a chunk of
`chunk` tokens after `prefix` cached ones. Each timed call runs the op `repeats` times back to back inside
one jitted program, each call's output feeding the next call's query, on a different layer of a pool of at
least 256 MiB so that the 50 MB L2 holds no previous call's K/V; times include the launch gaps between those
kernels. The page-table width is
`--max-model-len` / page_size, as the engine sizes it: the reference gathers the whole width, the kernel
only the pages a row uses. `--sweep` also times the tuning grid and prints the best configuration per case.

Prefill kernel options (kernels/prefill_attention.py): `--exp2 on|off` (base-2 online softmax), `--lazy-rescale
on|off` (rescale the accumulator only when a row's max grows past the threshold), `--hoist-index on|off` (static
page index in unmasked key blocks); left out, the kernel's defaults. They apply to the plain row and to every
sweep entry that does not set them itself. `--prefill-grid` picks the prefill sweep: `tiles` (tile rows x
block_k x warps x stages, the heavy_first A/B), `softmax` (exp2 x lazy_rescale x stages at the default tiles,
block_k 64 and 32, and hoist_index on the exp2 points at block_k 64) or `all` (both, the default; the `tiles`
entries run the kernel's default softmax options). Each result row (JSON) holds `config` (the sweep entry, with
the option flags merged in) and, added since session 6, `options` (every keyword argument the kernel ran with,
its defaults filled in; None = the kernel's tuning table).

`--dense-baselines` (prefill cases with prefix 0, the choose-by-measurement item of issue 5): also times two
library kernels on the same causal problem with contiguous, unpaged q/k/v [rows, chunk, heads, dim]: JAX's
Mosaic GPU flash attention for Hopper (`jax.experimental.pallas.ops.gpu.attention_mgpu`: TMA, wgmma, a
producer warpgroup; GQA native) and JAX's Triton flash attention (`...ops.gpu.attention.mha`; K/V repeated to
every query head, since it has no GQA). They cannot read pages or start after a prefix, so they bound what
a kernel built on their schedule would reach, rather than being drop-in replacements. When tokamax is importable
(session 8) its Mosaic GPU sm90 kernel (two consumer warpgroups and a TMA producer, FA3's schedule; GQA native;
`TOKAMAX_SWEEP`) and its Triton kernel are timed the same way.

Every prefill case also has a `split` row (session 8): the engine's prefill attention, the chunk part on
tokamax's kernel and the paged prefix in a Triton pass (`kernels/chunk_attention.py`); the plain row is the
one-kernel Triton version.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import sys

import numpy as np
from jax_timing import best_seconds

from qwen35_jax.roofline import BF16_FLOPS_PER_S, HBM_BYTES_PER_S
from qwen35_jax.serving.offline_bench import save_json

MIN_POOL_BYTES = 256 * 2**20

DECODE_SWEEP = [dict(block_k=bk, num_warps=w, num_stages=s) for bk, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]  # fmt: skip
PREFILL_SWEEP = [dict(tile_rows=r, block_k=bk, num_warps=w, num_stages=s)
                 for r, bk, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))]  # fmt: skip
# The grid above walks the causal query blocks last-first (heavy_first, the default since session 4); the best of
# it and its neighbours in order, for the A/B.
PREFILL_SWEEP += [dict(tile_rows=128, block_k=bk, num_warps=8, num_stages=s, heavy_first=False)
                  for bk, s in ((64, 2), (64, 3), (32, 2))]  # fmt: skip
# The prefill kernel's softmax options at the default tiles (128 rows, 8 warps, heavy first): exp2 x lazy_rescale x
# 2/3 stages at block_k 64 and 32, then hoist_index on the exp2 points at block_k 64.
PREFILL_SOFTMAX_SWEEP = [dict(tile_rows=128, block_k=bk, num_warps=8, num_stages=s, exp2=e, lazy_rescale=z)
                         for bk, s, e, z in itertools.product((64, 32), (2, 3), *[(False, True)] * 2)]  # fmt: skip
PREFILL_SOFTMAX_SWEEP += [dict(tile_rows=128, block_k=64, num_warps=8, num_stages=s, exp2=True, lazy_rescale=z,
                               hoist_index=True) for s, z in itertools.product((2, 3), (False, True))]  # fmt: skip
PREFILL_GRIDS = dict(tiles=PREFILL_SWEEP, softmax=PREFILL_SOFTMAX_SWEEP, all=PREFILL_SWEEP + PREFILL_SOFTMAX_SWEEP)
# The prefill kernel's boolean options that have a flag (--exp2 on|off, --lazy-rescale, --hoist-index).
PREFILL_FLAGS = ("exp2", "lazy_rescale", "hoist_index")


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
    return max(bytes_moved / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S)


def prefill_options(config: dict, group: int) -> dict:
    """A sweep entry in tile rows -> the kernel's block_q for this GQA group."""
    config = dict(config)
    rows = config.pop("tile_rows", None)
    if rows is not None:
        config["block_q"] = max(1, rows // (1 << (group - 1).bit_length()))
    return config


def kernel_options(kernel, options: dict) -> dict:
    """Every keyword argument of `kernel` (interpret aside) as it runs with `options`: its defaults filled in."""
    params = inspect.signature(kernel).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name != "interpret"}
    return {**defaults, **options}


def bench_case(kind: str, case: dict, shape: dict, args, configs: list[dict]) -> list[dict]:
    """Time the reference and every kernel configuration of one case; one result row per configuration (prefill
    entries on top of the option flags, `prefill_flag_options`)."""
    import jax.numpy as jnp

    from qwen35_jax.kernels.decode_attention import paged_decode_attention_pallas, paged_decode_attention_ref
    from qwen35_jax.kernels.prefill_attention import paged_prefill_attention_pallas, paged_prefill_attention_ref

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
        ref, kernel = paged_decode_attention_ref, paged_decode_attention_pallas
    else:
        starts, lengths = [case["prefix"]] * case["rows"], [case["chunk"]] * case["rows"]
        ends = [s + n for s, n in zip(starts, lengths, strict=True)]
        q, k, v, table, layers = make_inputs(
            rng, ends, heads, kv_heads, dim, page_size, width, dtype, case["chunk"], pool
        )
        rest = (table, jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32))
        work = prefill_work(starts, lengths, case["chunk"], heads, kv_heads, dim, itemsize)
        ref, kernel = paged_prefill_attention_ref, paged_prefill_attention_pallas
    timing = dict(layers=layers, repeats=args.repeats, trials=args.trials)
    operands = (q, k, v, *rest)
    ref_s = seconds_per_call(ref, operands, **timing)
    rows = []
    for config in configs:
        if kind == "prefill":
            config = {**prefill_flag_options(args), **config}
            options = prefill_options(config, heads // kv_heads)
        else:
            options = dict(config)
        op = functools.partial(kernel, interpret=args.interpret, **options)
        try:
            kernel_s = seconds_per_call(op, operands, **timing)
        except Exception as error:  # a configuration that does not compile (shared memory, registers)
            rows.append(dict(kind=kind, **case, config=config, error=f"{type(error).__name__}: {error}"[:200],
                             options=kernel_options(kernel, options)))  # fmt: skip
            continue
        rows.append(timed_row(kind, case, config, kernel_s, work, ref_s, options=kernel_options(kernel, options)))
    if kind == "prefill":
        rows.append(split_row(case, args, operands, timing, work, ref_s))
    return rows


def split_row(case: dict, args, operands, timing: dict, work, ref_s: float) -> dict:
    """The engine's prefill attention since session 8 (`kernels/chunk_attention.py`): the chunk part on tokamax's
    Mosaic GPU kernel over the chunk's own k, v (random here: the timing does not depend on them), then the prefix
    pass over the pages, timed as the one-kernel rows."""
    import jax.numpy as jnp

    from qwen35_jax.kernels.chunk_attention import prefill_attention_pallas

    q, k_pages = operands[0], operands[1]
    rng = np.random.default_rng(1)
    chunk_kv = [jnp.asarray(rng.standard_normal((*q.shape[:2], *k_pages.shape[3:]), np.float32), q.dtype)
                for _ in range(2)]  # fmt: skip

    def op(q, k_pages, v_pages, layer, table, start, lengths, k, v):
        return prefill_attention_pallas(q, k, v, k_pages, v_pages, layer, table, start, lengths,
                                        interpret=args.interpret)  # fmt: skip

    config = dict(impl="split")
    try:
        seconds = seconds_per_call(op, (*operands, *chunk_kv), **timing)
    except Exception as error:
        return dict(kind="prefill", **case, config=config, error=f"{type(error).__name__}: {error}"[:300])
    return timed_row("prefill", case, config, seconds, work, ref_s)


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
# tokamax's Mosaic GPU (sm90) flash attention: block_q rows per compute warpgroup (two of them), block_kv keys a TMA
# stage; at head_dim 256 the q tile and two stages of K and V fill ~192 KiB of shared memory at block_kv 64.
TOKAMAX_SWEEP = [dict(block_q=bq, block_kv=bk, num_stages=s) for bq, bk, s in ((64, 64, 2), (64, 64, 3), (64, 128, 2))]


def tokamax_candidates(dim: int) -> list[tuple]:
    """(name, config, op) for tokamax's Mosaic GPU and Triton flash attention, or none when tokamax is absent."""
    try:
        from tokamax._src.ops.attention import pallas_mosaic_gpu, pallas_triton
    except ImportError as error:
        print(f"tokamax not importable ({error}); its baselines are skipped")
        return []

    def mosaic(config):
        attention = pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(config=pallas_mosaic_gpu.ConfigSM90(**config))
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


def prefill_flag_options(args) -> dict:
    """The prefill kernel options given on the command line (--exp2 on|off ...): {keyword: bool}."""
    return {name: getattr(args, name) == "on" for name in PREFILL_FLAGS if getattr(args, name) is not None}


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
    parser.add_argument("--prefill-grid", choices=sorted(PREFILL_GRIDS), default="all",
                        help="which prefill grid --sweep times (module docstring)")  # fmt: skip
    for flag, what in (("exp2", "base-2 online softmax"), ("lazy_rescale", "lazy accumulator rescaling"),
                       ("hoist_index", "static page index in unmasked key blocks")):  # fmt: skip
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, choices=("on", "off"), default=None,
                            help=f"prefill kernel: {what} (default: the kernel's)")  # fmt: skip
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
        configs = [{}] + (
            (DECODE_SWEEP if kind == "decode" else PREFILL_GRIDS[args.prefill_grid]) if args.sweep else []
        )
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
