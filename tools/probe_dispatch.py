"""What a step's launch costs the host, part by part: the dispatch of a compiled program against its argument count,
inputs handed over as numpy arrays against device arrays, and starting an output's copy to the host against
writing it to pinned host memory.

The engine's launch is one compiled call with ~330 arguments (the weights, the caches, the step's inputs), its
inputs come as one packed numpy array (`InputLayout`), and it starts a device-to-host copy of each output the host
will read (`Runner.launch`). The issue's host-time line counts all of it, so this probe prices each part alone on the
machine at hand. Every figure is host time a call, the calls dispatched back to back with no waits (the device
work is a few microseconds, so nothing queues behind it).

    JAX_PLATFORMS=cuda python3 tools/probe_dispatch.py --json dispatch.json
"""

from __future__ import annotations

import argparse
import json
import time


def per_call_us(fn, calls: int) -> float:
    """Host microseconds a call of fn(), after 50 warm-up calls; waits once at the end."""
    import jax

    for _ in range(50):
        out = fn()
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    elapsed = time.perf_counter() - start
    jax.block_until_ready(out)
    return elapsed / calls * 1e6


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--args", type=int, nargs="+", default=[10, 100, 330, 600])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = {"device": str(jax.devices()[0].device_kind)}

    # A program of n small bf16 arguments that reads two of them, as a step reads each weight in one place.
    for n in args.args:
        xs = [jnp.full((2048,), i, jnp.bfloat16) for i in range(n)]
        program = jax.jit(lambda *a: a[0] + a[1]).lower(*xs).compile()
        rows[f"dispatch_{n}_args_us"] = per_call_us(lambda p=program, xs=xs: p(*xs), args.calls)

    # A decode step's inputs at one row: tokens, positions and slots [1], the page table [1, 80].
    shapes = [(1,), (1,), (1,), (1, 80)]
    on_device = [jnp.zeros(s, jnp.int32) for s in shapes]
    on_host = [np.zeros(s, np.int32) for s in shapes]
    program = jax.jit(lambda t, p, s, w: t + p + s + w[:, 0]).lower(*on_device).compile()
    rows["inputs_from_device_us"] = per_call_us(lambda: program(*on_device), args.calls)
    rows["inputs_from_numpy_us"] = per_call_us(lambda: program(*on_host), args.calls)
    # The same inputs packed into one numpy array, as the runner sends them.
    packed = np.zeros(sum(np.prod(s) for s in shapes), np.int32)
    program = jax.jit(lambda x: x[0:1] + x[1:2] + x[2:3] + x[3:].reshape(1, 80)[:, 0]).lower(packed).compile()
    rows["packed_inputs_from_numpy_us"] = per_call_us(lambda: program(packed), args.calls)

    # Starting an output's copy to the host, after a one-argument program.
    x = jnp.ones((1,), jnp.int32)
    add = jax.jit(lambda v: v + 1).lower(x).compile()

    def add_and_copy():
        out = add(x)
        out.copy_to_host_async()
        return out

    rows["one_arg_program_us"] = per_call_us(lambda: add(x), args.calls)
    rows["one_arg_program_and_copy_us"] = per_call_us(add_and_copy, args.calls)
    # The program writing its output to pinned host memory instead (no copy to start), and each form's whole
    # round trip: the call, then the output read on the host (np.asarray waits for the tiny program).
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    add_pinned = jax.jit(lambda v: v + 1, out_shardings=pinned).lower(x).compile()
    rows["one_arg_program_to_pinned_host_us"] = per_call_us(lambda: add_pinned(x), args.calls)
    rows["copy_round_trip_us"] = per_call_us(lambda: np.asarray(add_and_copy()), args.calls)
    rows["pinned_host_round_trip_us"] = per_call_us(lambda: np.asarray(add_pinned(x)), args.calls)
    for key, value in rows.items():
        print(f"{key:32s} {value if isinstance(value, str) else f'{value:8.1f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
