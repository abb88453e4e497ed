"""What a kernel boundary costs a batch-1 decode step: a chain of weight products in one program against one
product that reads the same bytes.

A batch-1 step is ~120 weight products (`kernels.linear`) with small kernels between them, and each product ran
~2.5-3.8 us above its bytes at the copy rate (docs/performance.md). This prices that gap apart from the model:

- `single`: one product of x [1, K] with a weight of n x N rows (one kernel, n x the bytes of one product);
- `independent`: n products of the same x with n distinct [N, K] weights, one after another in one program (XLA
  orders them in its command buffer as a chain, though none reads another's output);
- `dependent`: n products where each one's x is the first K columns of the previous one's output, as a step's
  products feed each other.

(chain - single) / (n - 1) is what one boundary costs. Every figure is the wall time a call over --calls calls
dispatched back to back, the device the bottleneck (a call is ~n x 10 us of weight reads). XLA's programmatic
dependent launch (PDL: each kernel may start while the one before it ends, and waits at its entry) is on by
default from Hopper on; run the probe again under XLA_FLAGS=--xla_gpu_enable_pdl=false to see what it gives.

    JAX_PLATFORMS=cuda python3 tools/probe_boundaries.py --json boundaries.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def per_call_us(fn, calls: int) -> float:
    """Wall microseconds a call of fn() over `calls` calls after 20 warm-up calls, waiting once at the end."""
    import jax

    for _ in range(20):
        out = fn()
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e6


def programs(k: int, interpret: bool):
    """(single, independent, dependent): the three programs of the module docstring, as functions of (x, weights);
    single's weights are one array of the chain's rows."""
    import functools

    from qwen35_jax.kernels.linear import linear_parts_pallas

    product = functools.partial(linear_parts_pallas, interpret=interpret)

    def single(x, weights):
        return product(x, weights[0])

    def independent(x, weights):
        return tuple(product(x, w) for w in weights)

    def dependent(x, weights):
        for w in weights:
            x = product(x, w)[0, :, :k].astype(x.dtype)
        return x

    return single, independent, dependent


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--products", type=int, default=16, help="n: products a chain")
    parser.add_argument("--out", type=int, default=10240, help="N: a product's output columns (>= K)")
    parser.add_argument("--in", dest="k", type=int, default=2560, help="K: a product's input columns")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many timings of --calls calls")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    n, rows_n, k = args.products, args.out, args.k
    if rows_n < k:
        parser.error("--out must be >= --in (a dependent product reads the first K columns of the last output)")

    key = jax.random.key(0)
    x = jax.random.normal(key, (1, k), jnp.bfloat16)
    weights = [jax.random.normal(jax.random.fold_in(key, i), (rows_n, k), jnp.bfloat16) * 0.02 for i in range(n)]
    # Off a GPU the kernels run in Pallas interpret mode (the figures then say nothing; the tool's test runs so).
    single, independent, dependent = programs(k, interpret=jax.default_backend() != "gpu")
    big = [jnp.concatenate(weights)]  # one weight of the chain's bytes, made once outside the timed program
    rows = {"device": str(jax.devices()[0].device_kind), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "products": n, "out": rows_n, "in": k, "bytes_per_product": rows_n * k * 2}  # fmt: skip
    for name, fn, ws in (("single", single, big), ("independent", independent, weights),
                         ("dependent", dependent, weights)):  # fmt: skip
        compiled = jax.jit(fn).lower(x, ws).compile()
        rows[f"{name}_us"] = min(per_call_us(lambda c=compiled, w=ws: c(x, w), args.calls)
                                 for _ in range(args.repeats))  # fmt: skip
    for chain in ("independent", "dependent"):
        rows[f"{chain}_boundary_us"] = (rows[f"{chain}_us"] - rows["single_us"]) / (n - 1)
    for name, value in rows.items():
        print(f"{name:26s} {value if isinstance(value, str) else f'{value:10.2f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
