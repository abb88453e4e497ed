"""Probe: tokamax non-causal over a gathered contiguous prefix (what a tokamax prefix part would cost)."""

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, sys.argv[1] + "/tools")
from jax_timing import best_seconds  # noqa: E402
from tokamax._src.ops.attention import pallas_mosaic_gpu as pm  # noqa: E402

op = pm.PallasMosaicGpuFlashAttention(config=pm.ConfigSM90(block_q=64, block_kv=64, num_stages=2))
key = jax.random.key(0)
for chunk, prefix in ((1024, 7168), (1024, 3072), (1024, 1024)):
    q = jax.random.normal(key, (1, chunk, 16, 256), jnp.bfloat16)
    pages = jax.random.normal(key, (2, 1024, 16, 4, 256), jnp.bfloat16)
    table = jax.random.permutation(key, 1024)[: prefix // 16][None].astype(jnp.int32)

    def program(q, pages, table, prefix=prefix):
        for i in range(10):
            k = pages[i % 2][table].reshape(1, prefix, 4, 256)
            q = op(q, k, k, is_causal=False).astype(q.dtype)
        return q

    f = jax.jit(program)
    jax.block_until_ready(f(q, pages, table))
    s = best_seconds(lambda f=f, q=q, pages=pages, table=table: jax.block_until_ready(f(q, pages, table)), 5) / 10
    flops = 4 * chunk * prefix * 16 * 256
    print(
        f"tokamax prefix probe chunk={chunk} prefix={prefix}: {s * 1e6:.1f} us (gather included), "
        f"{100 * flops / 790e12 / s:.1f}% of bf16 roofline"
    )
