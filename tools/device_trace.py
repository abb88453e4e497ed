"""Device kernel times from a jax.profiler trace directory (the newest *.trace.json.gz under it)."""

from __future__ import annotations

import collections
import glob
import gzip
import json


def _events(trace_dir: str, on_gpu: bool) -> list[dict]:
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in names.items() if "/device:GPU" in name}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e.get("pid") in gpu_pids) == on_gpu]


def device_kernels(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the GPU device lanes: one per kernel or memcpy run."""
    return _events(trace_dir, on_gpu=True)


def host_events(trace_dir: str) -> list[dict]:
    """The complete events of the host threads (JAX dispatch, PjRt execute and transfers, Python)."""
    return _events(trace_dir, on_gpu=False)


def time_by_name(kernels: list[dict], calls: int, top: int) -> dict[str, float]:
    """Milliseconds per call of the `top` kernel names (name cut at "(" and 60 characters), largest first."""
    by_name = collections.Counter()
    for e in kernels:
        by_name[e["name"].split("(")[0][:60]] += e["dur"]
    return {name: us / calls / 1e3 for name, us in by_name.most_common(top)}
