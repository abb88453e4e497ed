"""Do two stream regions of one layer run at once? A synthetic layer stack shaped like the overlapped step.

Each layer: one GEMM over all rows on the program's own stream, its rows split in two, a low-occupancy Pallas
kernel over the first part (the decode side's mixers) and a wider one over the second (the prefill side's),
the two outputs joined and fed to the next layer's GEMM. The variants put the two kernels in stream regions or
not, and compile with XLA options, so that the schedule XLA picks and the device time it gives can be compared
with the same program without regions and with each side alone.

For each variant it prints the device time per run (back to back), the schedule of the regions in the
compiled HLO (most open at once, and how many started while another was open) and, from a profiler trace, the
kernels' summed time against their span and the busy time per trace lane.

    python3 tools/probe_stream_schedule.py --layers 8 --json probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time

from device_trace import trace_events


def spin_kernel(ctas: int, iters: int, width: int):
    """A Pallas (Triton) kernel of `ctas` programs, each `iters` dependent FMA rounds over a [width] row."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        x = x_ref[...].astype(jnp.float32)

        def step(_, acc):
            return acc * 0.999 + x * 0.001

        o_ref[...] = jax.lax.fori_loop(0, iters, step, x).astype(o_ref.dtype)

    def call(x):
        return pl.pallas_call(
            body,
            grid=(ctas,),
            in_specs=[pl.BlockSpec((1, width), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((1, width), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        )(x)

    return call


def build(layers, rows_d, rows_p, hidden, d_iters, p_iters, annotate, group):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental.compute_on import compute_on

    decode_k = spin_kernel(rows_d, d_iters, hidden)
    prefill_k = spin_kernel(rows_p, p_iters, hidden)

    def region(fn, stream, layer=None):
        if stream is None:
            return fn
        if group == "call":
            from jax.experimental.xla_metadata import xla_metadata_call2

            attrs = {"_xla_stream_annotation": str(stream), "inlineable": "false", "_scheduling_group_id": str(layer)}
            return xla_metadata_call2(fn, attrs)
        return compute_on(fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)

    def forward(x, ws):
        for i in range(layers):
            y = lax.dot_general(x, ws[i], (((1,), (0,)), ((), ())))
            yd, yp = lax.slice_in_dim(y, 0, rows_d), lax.slice_in_dim(y, rows_d, rows_d + rows_p)
            sd = 1 if "d" in annotate else None
            sp = 2 if "p" in annotate else None
            if group == "call":
                sides = [region(decode_k, sd, i)(yd), region(prefill_k, sp, i)(yp)]
            elif group:
                from jax.experimental.xla_metadata import set_xla_metadata

                with set_xla_metadata(_scheduling_group_id=str(i)):
                    sides = [region(decode_k, sd)(yd), region(prefill_k, sp)(yp)]
            else:
                sides = [region(decode_k, sd)(yd), region(prefill_k, sp)(yp)]
            x = jnp.concatenate(sides)
        return x

    x = jnp.ones((rows_d + rows_p, hidden), jnp.bfloat16)
    ws = [jnp.full((hidden, hidden), 1.0 / hidden, jnp.bfloat16) for _ in range(layers)]
    return forward, x, ws


def region_schedule(text: str) -> dict:
    entry = text[text.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    open_regions, most, beside, starts = set(), 0, 0, 0
    for line in entry.splitlines():
        start = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .* call-start\(", line)
        done = re.search(r" call-done\(%?([\w.-]+)", line)
        if start:
            starts += 1
            beside += bool(open_regions)
            open_regions.add(start.group(1))
            most = max(most, len(open_regions))
        elif done:
            open_regions.discard(done.group(1))
    return {"starts": starts, "most_open": most, "started_beside_another": beside}


def time_ms(fn, args, runs):
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(runs):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / runs)
    return best * 1e3


def trace(fn, args, runs):
    import jax

    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp(prefix="probe_trace_")
    jax.profiler.start_trace(d)
    for _ in range(runs):
        out = fn(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    kernels, _ = trace_events(d)
    lanes = collections.Counter()
    for e in kernels:
        lanes[f"{e['pid']}/{e['tid']}"] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    return {
        "kernel_sum_ms": sum(e["dur"] for e in kernels) / runs / 1e3,
        "span_ms": span / runs / 1e3,
        "lanes_ms": {k: v / runs / 1e3 for k, v in lanes.most_common(6)},
    }


OPTIONS = {
    "lhs": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "nocb": {"xla_gpu_enable_command_buffer": ""},
    "cbserial": {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"},
    "cbconc": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    "cbregions": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT_REGIONS"},
    "cblhs": {"xla_gpu_command_buffer_scheduling_mode": "LHS"},
    "graphconc": {"xla_gpu_graph_enable_concurrent_region": True},
}


def main():
    import jax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows-d", type=int, default=2)
    parser.add_argument("--rows-p", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--d-iters", type=int, default=20000)
    parser.add_argument("--p-iters", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--variants", default="none,dp,dp+lhs,dp+nocb,dp+lhs+nocb,dp+group,dp+group+lhs,p,d")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"args": vars(args), "variants": {}}
    for variant in args.variants.split(","):
        annotate, *opts = variant.split("+")
        group = "call" if "cgrp" in opts else "group" in opts
        options = {}
        for o in opts:
            options.update(OPTIONS[o] if o not in ("group", "cgrp") else {})
        forward, x, ws = build(args.layers, args.rows_d, args.rows_p, args.hidden, args.d_iters, args.p_iters,
                               annotate, group)  # fmt: skip
        try:
            compiled = jax.jit(forward).lower(x, ws).compile(options or None)
            row = {"ms": time_ms(compiled, (x, ws), args.runs), "schedule": region_schedule(compiled.as_text())}
            row["trace"] = trace(compiled, (x, ws), args.runs)
        except Exception as e:  # a variant that fails to compile or run is reported, the others go on
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        report["variants"][variant] = row
        print(json.dumps({variant: row}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
