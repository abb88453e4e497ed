"""Where the engine's launch of a decode step spends the host's time, without a profiler (whose Python tracing
inflates the small calls it wraps): `Runner.launch`, the compiled call inside it and `Runner.inputs_for` are timed
by wrapping them, over steady decode steps of `--batch` rows, with the step's fetch and the whole step beside them.
What the launch spends beyond the call and the inputs is the rest of `Runner.launch`: starting the outputs' copies
to the host and its bookkeeping.

    JAX_PLATFORMS=cuda python3 tools/launch_split.py --model 4b --batch 1 --steps 60
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    import numpy as np
    import profile_decode

    from qwen35_jax.api import load_model
    from qwen35_jax.serving.runner import StepHandle

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="4b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the medians")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.3)
    args = parser.parse_args(argv)
    args.compile_cache, args.kernels, args.prefill = None, None, 0  # what profile_decode's engine builder reads
    engine, key = profile_decode._decode_engine(args, load_model(args.model))
    runner, spent = engine.runner, {name: [] for name in ("inputs_for", "call", "launch", "fetch", "step")}

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name].append(time.perf_counter() - start)

        return wrapper

    runner.inputs_for = timed("inputs_for", runner.inputs_for)
    runner.executables[key] = timed("call", runner.executables[key])
    runner.launch = timed("launch", runner.launch)
    fetch = StepHandle.fetch
    StepHandle.fetch = lambda handle: timed("fetch", fetch)(handle)
    try:
        for _ in range(args.steps):
            timed("step", engine.step)()
    finally:
        StepHandle.fetch = fetch
    for name, values in spent.items():
        ms = np.asarray(values[args.skip :]) * 1e3
        print(f"{name:11s} n={len(ms)} median {np.median(ms):.3f} ms  p10 {np.percentile(ms, 10):.3f}  "
              f"p90 {np.percentile(ms, 90):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
