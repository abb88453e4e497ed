"""The device's physical limits that every benchmark figure is printed beside (`qwen35_jax/roofline.py`): HBM
bandwidth as a device-to-device copy, and the dense bf16 matrix rate as an 8192^3 product on random data.

    JAX_PLATFORMS=cuda python tools/device_limits.py --json limits.json

A copy reads and writes every byte once: bandwidth = 2 x bytes / time. The product does 2 x 8192^3 FLOPs. Each is
chained --iters times inside one jitted loop (each iteration's output feeds the next, so XLA cannot drop work and
host dispatch is not counted), best of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from jax_timing import chained_seconds


def copy_bytes_per_s(gib: float, iters: int, repeats: int) -> float:
    import jax.numpy as jnp

    x = jnp.zeros(int(gib * 2**30) // 4, jnp.float32)
    # x + i touches every element and cannot be folded into a no-op across iterations.
    seconds, _ = chained_seconds(lambda i, x: (None, x + i.astype(x.dtype)), None, x, iters, repeats, donate=True)
    return 2 * x.nbytes / seconds


def bf16_flops_per_s(n: int, iters: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / n**0.5  # keeps the chain's values bounded

    def step(i, x):
        return None, jnp.dot(x, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    seconds, _ = chained_seconds(step, None, a, iters, repeats)
    return 2 * n**3 / seconds


def main(argv=None) -> int:
    import jax

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    result = {
        "device": device.device_kind,
        "hbm_tb_per_s": copy_bytes_per_s(args.copy_gib, args.iters, args.repeats) / 1e12,
        "bf16_tflop_per_s": bf16_flops_per_s(args.matmul_n, args.iters, args.repeats) / 1e12,
        **vars(args),
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
