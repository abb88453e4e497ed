"""Device time of JAX work for the kernel benchmarks: best-of timing, and a step chained through its state inside
one jitted loop, as serving carries a state from step to step, so that host dispatch is not counted."""

from __future__ import annotations

import time


def best_seconds(run, repeats: int) -> float:
    """The shortest wall time of `repeats` calls of run() (run must block until its work is done)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def chained_seconds(step, first_out, state, iters: int, repeats: int, donate: bool = False):
    """(seconds per call, state): step(i, state) -> (out, state) called `iters` times in one jitted fori_loop,
    each call on the previous call's state; best of `repeats` runs after one warm-up. With donate the state
    buffer is donated and each run starts from the last run's state (returned for the next caller)."""
    import functools

    import jax

    @functools.partial(jax.jit, donate_argnums=0 if donate else ())
    def chain(state):
        return jax.lax.fori_loop(0, iters, lambda i, carry: step(i, carry[1]), (first_out, state))

    result = [jax.block_until_ready(chain(state))]

    def run():
        result[0] = jax.block_until_ready(chain(result[0][1] if donate else state))

    return best_seconds(run, repeats) / iters, result[0][1]


def roofline_row(rows: list, label: str, seconds: float, floor_s: float, json_path: str | None, **fields) -> dict:
    """Appends {**fields, us, floor_us, roofline_pct} to rows, prints it beside its floor, and rewrites json_path
    (the benchmarks keep what they measured when a run is stopped)."""
    from qwen35_jax.serving.offline_bench import save_json

    row = dict(fields, us=seconds * 1e6, floor_us=floor_s * 1e6, roofline_pct=100 * floor_s / seconds)
    rows.append(row)
    print(f"{label} {row['us']:8.1f} us  floor {row['floor_us']:6.1f} us  {row['roofline_pct']:5.1f}% of roofline",
          flush=True)  # fmt: skip
    save_json(json_path, rows)
    return row


def parse_gpu_benchmark_args(parser, argv, iters: int):
    """Adds the timing and output flags every weight-GEMM benchmark takes (--batch, --iters, --repeats, --json),
    parses argv, and returns the args, or None (after saying why) when JAX has no GPU to time."""
    import sys

    import jax

    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("GPU only", file=sys.stderr)
        return None
    return args
