"""Profile one unified step program (B decode rows beside a T-token chunk) under `--decode-overlap off` and
`stream`, and the two sides run as separate programs, on the GPU with random weights at a preset's shapes.

For each variant it reports the back-to-back device time of the unified program, of the decode-only and
prefill-only programs, and from a profiler trace of the unified program: the kernels' summed time, the span from
the first kernel's start to the last one's end (below the sum only where two streams ran at once), the time
each stream lane was busy, the largest kernels, and the program's scratch and HLO copies.

Variants (`--variants`): `off`; `stream` (on a GPU the unified program's command buffer is concurrent,
`runner.CONCURRENT_GRAPH`). Suffixes add XLA options to the variant's compiles: `+lhs`, XLA's latency-hiding
scheduler; `+nocb`, command buffers (CUDA graphs) off; `+cbserial` / `+cbconc`, the command buffer serialised /
concurrent for every program of the variant.

    python3 tools/profile_overlap.py --model 4b --batch 16 --chunk 256 --json profile_overlap.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re

from device_trace import time_by_name, traced_program


def build_runner(model, mode: str, batch: int, chunk: int):
    from qwen35_jax.cache import CacheSpec
    from qwen35_jax.serving.runner import Buckets, Runner

    buckets = Buckets(decode=(batch,), prefill_rows=(1,), chunk=(chunk,))
    return Runner(model.model_def, model.params, model.kernels, CacheSpec(2048, 16, batch + 1), buckets, 2048,
                  decode_overlap=mode)  # fmt: skip


def trace_summary(runner, key, runs: int, top: int) -> dict:
    kernels = traced_program(runner, key, runs)
    lanes = collections.Counter()
    for e in kernels:
        lanes[f"{e['pid']}/{e['tid']}"] += e["dur"]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    copies = [e for e in kernels if "copy" in e["name"].lower() or "memcpy" in e["name"].lower()]
    return {
        "kernels_per_step": len(kernels) / runs,
        "kernel_sum_ms_per_step": sum(e["dur"] for e in kernels) / runs / 1e3,
        "span_ms_per_step": (end - start) / runs / 1e3,
        "lane_busy_ms_per_step": {lane: us / runs / 1e3 for lane, us in lanes.most_common()},
        "copy_kernels_ms_per_step": sum(e["dur"] for e in copies) / runs / 1e3,
        "top_kernels_ms_per_step": time_by_name(kernels, runs, top),
    }


def hlo_counts(executable) -> dict:
    text = executable.as_text()
    return {
        "call_start": text.count("call-start("),
        "copies": len(re.findall(r" copy\(", text)),
        "copy_starts": len(re.findall(r" copy-start\(", text)),
        "gathers": len(re.findall(r" gather\(", text)),
        "scatters": len(re.findall(r" scatter\(", text)),
    }


# Variant suffixes: XLA's latency-hiding scheduler; command buffers (CUDA graphs) off, serialised, concurrent.
XLA_OPTIONS = {
    "lhs": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "nocb": {"xla_gpu_enable_command_buffer": ""},
    "cbserial": {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"},
    "cbconc": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
}


def _compile_with(options: dict) -> None:
    """Every program the runners compile from now on gets these XLA options too (and no earlier call's)."""
    from qwen35_jax.serving.runner import Runner

    base = getattr(Runner, "_plain_compiler_options", Runner.compiler_options)
    Runner._plain_compiler_options = base

    def compiler_options(self, family, key):
        return {**(base(self, family, key) or {}), **options} or None

    Runner.compiler_options = compiler_options


def main() -> None:
    from qwen35_jax.api import load_model
    from qwen35_jax.serving.factory import enable_compile_cache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--variants", default="off,stream,off+cbconc,stream+nocb")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--kernels", default="pallas")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--hlo-dir", default=None, help="write each variant's optimised unified HLO here")
    args = parser.parse_args()
    enable_compile_cache(args.compile_cache)
    model = load_model(args.model, dtype="bfloat16", kernels=args.kernels)
    unified, decode, prefill = (args.batch, 1, args.chunk), (args.batch, 0, 0), (0, 1, args.chunk)
    report = {"model": args.model, "key": list(unified), "variants": {}}
    for variant in args.variants.split(","):
        variant, _, options = variant.partition("+")
        _compile_with({k: v for o in options.split("+") if o for k, v in XLA_OPTIONS[o].items()})
        runner = build_runner(model, "off" if variant == "off" else "stream", args.batch, args.chunk)
        runner.compile_all()
        costs = runner.measure_step_costs([decode, prefill, unified], repeats=args.runs)
        variant += f"+{options}" if options else ""
        report["variants"][variant] = {
            "unified_ms": costs[unified] * 1e3,
            "decode_only_ms": costs[decode] * 1e3,
            "prefill_only_ms": costs[prefill] * 1e3,
            "sides_in_sequence_ms": (costs[decode] + costs[prefill]) * 1e3,
            "scratch_mib": runner.temp_bytes[unified] / 2**20,
            "hlo": hlo_counts(runner.executables[unified]),
            "trace": trace_summary(runner, unified, args.runs, args.top),
        }
        if args.hlo_dir:
            with open(f"{args.hlo_dir}/{variant}.hlo.txt", "w") as f:
                f.write(runner.executables[unified].as_text())
        print(json.dumps({variant: report["variants"][variant]}), flush=True)
        del runner
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
