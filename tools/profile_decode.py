"""Profile steady decode steps (or prefill-only steps, `--prefill N`) of the engine on the GPU and summarise the
device trace: kernels per step,
busy device time per step against the step's wall time (what is left is launch and host gaps), and the
decode program's optimised HLO: its fusions, copies, while loops, Triton calls, and the normalisations
(fusions that compute an rsqrt), to see whether XLA fuses the norms with their neighbours.

    python tools/profile_decode.py --model 4b --batch 1 --context 1024 --trace-dir /tmp/trace \
        --kernels pallas --json profile.json
    python tools/profile_decode.py --model 4b --prefill 1024 --steps 5 --json profile_prefill_1024.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import numpy as np
from device_trace import time_by_name, trace_events

from qwen35_jax.roofline import require_device_limits


def summarise(kernels: list[dict], host: list[dict], steps: int, top: int) -> dict:
    """kernels, host: the trace's device and host events (`device_trace.trace_events`)."""
    return {
        "kernels_per_step": len(kernels) / steps,
        "device_busy_ms_per_step": sum(e["dur"] for e in kernels) / steps / 1e3,
        "top_kernels_ms_per_step": time_by_name(kernels, steps, top),
        # Where the host spends a step (nested events each count, so these overlap): a launch that blocks on
        # the device shows up here as a long PjRt execute or buffer wait.
        "top_host_events_ms_per_step": time_by_name(host, steps, top),
    }


def hlo_summary(text: str) -> dict:
    """Counts over the optimised HLO text of one program (every computation, loop bodies included)."""
    fusions = re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = [^=]*? fusion\(", text, re.M)
    norm_fusions, name, has_rsqrt = set(), None, False
    for line in text.splitlines():  # a computation starts with a line ending in "{" and ends with "}"
        if line.rstrip().endswith("{"):
            name, has_rsqrt = line.split()[0].lstrip("%"), False
        elif name is not None and " rsqrt(" in line:
            has_rsqrt = True
        elif line.startswith("}") and name is not None:
            if has_rsqrt and "fused" in name:
                norm_fusions.add(name)
            name = None
    return {
        "fusions": len(fusions),
        "copies": len(re.findall(r" copy\(", text)),
        "copy_starts": len(re.findall(r" copy-start\(", text)),
        "while_loops": len(re.findall(r" while\(", text)),
        "triton_calls": text.count("__gpu$xla.gpu.triton"),
        "custom_calls": len(re.findall(r" custom-call\(", text)),
        "fused_computations_with_rsqrt": len(norm_fusions),
    }


DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}


def _shape_bytes(shapes: str) -> int:
    """Bytes of every array shape written in an HLO operand or result list ("bf16[1,2560]{1,0} %x, ...")."""
    total = 0
    for dtype, dims in re.findall(r"\b(bf16|f16|f32|s32|u32|s8|u8|pred|f8e4m3fn)\[([\d,]*)\]", shapes):
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def kernel_traffic(kernels: list[dict], steps: int, hlo: str, top: int) -> list[dict]:
    """For the `top` device kernels by time whose name is a fusion or custom call of the optimised HLO: calls
    per step, the bytes one call's operands and result hold (a lower bound on what it moves), and the
    bandwidth that implies against the card's HBM bandwidth (4.3 TB/s on the H200). Names in the trace are the HLO instruction names with
    "." written "_"; identical fusions share one kernel and its first instruction's name."""
    shapes = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = (\S+(?: \S+\))?)", hlo, re.M))
    lines = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.-]+) = (.*?) (?:fusion|custom-call)\(([^)]*)\)", hlo, re.M):
        operands = " ".join(shapes.get(n, "") for n in re.findall(r"%([\w.-]+)", m.group(3)))
        lines.setdefault(m.group(1).replace(".", "_"), (m.group(2), operands))
    us, calls = {}, {}
    for e in kernels:
        name = e["name"].split("(")[0]
        us[name] = us.get(name, 0.0) + e["dur"]
        calls[name] = calls.get(name, 0) + 1
    rows = []
    for name in sorted(us, key=us.get, reverse=True):
        if name not in lines:
            continue
        result, operands = lines[name]
        nbytes = _shape_bytes(result) + _shape_bytes(operands)
        per_step_s = us[name] / steps / 1e6
        rows.append({"kernel": name, "ms_per_step": per_step_s * 1e3, "calls_per_step": calls[name] / steps,
                     "bytes_per_call": nbytes, "result": result.split("{")[0],
                     "hbm_fraction": nbytes * calls[name] / steps / per_step_s / require_device_limits().hbm_bytes_per_s})  # fmt: skip
        if len(rows) == top:
            break
    return rows


def main() -> None:
    import jax

    from qwen35_jax.api import load_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="profile prefill-only steps of one prompt of this many tokens (one chunk) instead",
    )
    parser.add_argument("--trace-dir", default="/tmp/trace")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--kernels", default=None, help="pallas | ref (default: pallas on a GPU)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.3,
                        help="of free device memory for the pools: the profile needs only batch x (context + 60) "
                             "tokens. At 0.5 the batch-64/256 runs on the H200 stopped while compiling, XLA's "
                             "rematerialisation pass reporting the program over its memory limit")  # fmt: skip
    parser.add_argument("--top", type=int, default=25, help="kernels listed by time per step")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--hlo-out", default=None, help="write the profiled program's optimised HLO text here")
    parser.add_argument("--sequence-out", default=None,
                        help="write the last step's kernels in order here, a line each: start and duration in us, "
                             "the idle gap before it, and the name")  # fmt: skip
    args = parser.parse_args()
    model = load_model(args.model, kernels=args.kernels)
    engine, key = (_prefill_engine if args.prefill else _decode_engine)(args, model)
    jax.profiler.start_trace(args.trace_dir)
    start = time.perf_counter()
    for _ in range(args.steps):
        _profiled_step(engine, args)
    wall = (time.perf_counter() - start) / args.steps
    jax.profiler.stop_trace()
    hlo = engine.runner.executables[key].as_text()
    kernels, host = trace_events(args.trace_dir)
    report = {"batch": args.batch, "prefill_tokens": args.prefill, "program": list(key),
              "kernels": model.kernels.name, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "wall_ms_per_step": wall * 1e3, **summarise(kernels, host, args.steps, args.top),
              "program_hlo": hlo_summary(hlo),
              "top_kernel_traffic": kernel_traffic(kernels, args.steps, hlo, args.top),
              "program_scratch_bytes": engine.runner.temp_bytes[key]}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write(hlo)
    if args.sequence_out:
        with open(args.sequence_out, "w") as f:
            f.write(kernel_sequence(kernels, args.steps))


_PROMPTS = np.random.default_rng(0)


def _profiled_step(engine, args) -> None:
    """One decode step, or one prompt prefilled in its one prefill-only step (its single token ends it)."""
    if not args.prefill:
        engine.step()
        return
    from qwen35_jax.serving.engine import GenerationParams

    prompt = _PROMPTS.integers(0, 248044, args.prefill).tolist()  # a new prompt each time
    engine.submit(prompt, GenerationParams(1, ignore_eos=True), lambda out: None)
    engine.run_until_done()


def _prefill_engine(args, model):
    """An engine with the one prefill-only program (0, 1, prefill), warmed by two prompts."""
    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.serving.runner import Buckets

    config = EngineConfig(max_batch=1, max_prefill_tokens=args.prefill, max_model_len=args.prefill + 16,
                          gpu_memory_fraction=args.gpu_memory_fraction, compile_cache=args.compile_cache)  # fmt: skip
    engine = build_engine(model, config, compile_now=False)
    engine.runner.buckets = Buckets(decode=(1,), prefill_rows=(1,), chunk=(args.prefill,))
    engine.runner.compile_all()
    for _ in range(2):
        _profiled_step(engine, args)
    return engine, (0, 1, args.prefill)


def _decode_engine(args, model):
    """An engine with `batch` rows all decoding at `context`, after four steady steps."""
    from qwen35_jax.serving.engine import GenerationParams
    from qwen35_jax.serving.factory import EngineConfig, build_engine
    from qwen35_jax.serving.runner import Buckets

    # Every row must still be decoding when the last prompt is in: prompts are prefilled one chunk a step, so the
    # first row decodes `batch` tokens before the last one starts (60 tokens left batch 64 never all decoding).
    max_tokens = args.batch + args.steps + 16
    config = EngineConfig(
        max_batch=args.batch,
        max_prefill_tokens=args.context,
        max_model_len=args.context + max_tokens + 16,
        gpu_memory_fraction=args.gpu_memory_fraction,
        compile_cache=args.compile_cache,
    )
    engine = build_engine(model, config, compile_now=False)
    engine.runner.buckets = Buckets(decode=(args.batch,), prefill_rows=(1,), chunk=(args.context,))
    engine.runner.compile_all()
    rng = np.random.default_rng(0)
    for _ in range(args.batch):
        engine.submit(
            rng.integers(0, 248044, args.context).tolist(),
            GenerationParams(max_tokens, ignore_eos=True),
            lambda out: None,
        )

    def all_decoding():
        running = engine.scheduler.running.values()
        return len(running) == args.batch and all(r.remaining_prompt == 0 for r in running)

    for _ in range(4 * args.batch + 16):  # one prompt chunk a step, plus slack
        if all_decoding():
            break
        engine.step()
    else:
        raise SystemExit(f"the {args.batch} rows were never all decoding at once (pool or budget too small?)")
    for _ in range(4):
        engine.step()
    return engine, (args.batch, 0, 0)


def kernel_sequence(kernels: list[dict], steps: int) -> str:
    """The last step's kernels in start order (a step is len(kernels) / steps kernels), a line each:
    start offset, duration and the device's idle gap before the kernel, in us, then its name."""
    ordered = sorted(kernels, key=lambda e: e["ts"])[-(len(kernels) // steps) :]
    lines, end, first = [], ordered[0]["ts"], ordered[0]["ts"]
    for e in ordered:
        lines.append(f"{e['ts'] - first:9.1f} {e['dur']:8.2f} {max(0.0, e['ts'] - end):7.2f} {e['name'][:100]}")
        end = max(end, e["ts"] + e["dur"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
