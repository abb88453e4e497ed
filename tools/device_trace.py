"""Device kernel and host event times from a jax.profiler trace directory (the newest *.trace.json.gz under it)."""

from __future__ import annotations

import collections
import glob
import gzip
import json


def trace_events(trace_dir: str) -> tuple[list[dict], list[dict]]:
    """The complete ("X") events of the trace, read once: (GPU device lanes: one per kernel or memcpy run,
    host threads: JAX dispatch, PjRt execute and transfers, Python)."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in names.items() if "/device:GPU" in name}
    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return [e for e in complete if e.get("pid") in gpu_pids], [e for e in complete if e.get("pid") not in gpu_pids]


def time_by_name(events: list[dict], calls: int, top: int) -> dict[str, float]:
    """Milliseconds per call of the `top` event names (name cut at "(" and 60 characters), largest first; events
    are {"name", "dur" in microseconds}."""
    by_name = collections.Counter()
    for e in events:
        by_name[e["name"].split("(")[0][:60]] += e["dur"]
    return {name: us / calls / 1e3 for name, us in by_name.most_common(top)}


def traced_program(runner, key, runs: int) -> list[dict]:
    """The device events (`trace_events`) of `runs` back-to-back runs of a step program of a
    `qwen35_jax.serving.runner.Runner` on padding inputs, after two untraced runs that pay the one-time costs."""
    import tempfile

    import jax

    executable = runner.executables[key]
    inputs = runner.input_layout(key).pack(runner.padding_inputs(key))

    def run(n):
        for _ in range(n):
            runner.cache, runner.token_state, outputs, _ = executable(
                runner._param_leaves, runner.cache, runner.token_state, inputs
            )
        jax.block_until_ready(outputs)

    run(2)
    trace_dir = tempfile.mkdtemp(prefix="program_trace_")
    jax.profiler.start_trace(trace_dir)
    run(runs)
    jax.profiler.stop_trace()
    return trace_events(trace_dir)[0]
