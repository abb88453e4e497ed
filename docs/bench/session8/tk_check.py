"""Experiment: tokamax Mosaic sm90 attention vs our Triton prefill kernel and an fp32 reference, 4B heads."""

import sys

import jax
import jax.numpy as jnp
from tokamax._src.ops.attention import pallas_mosaic_gpu as pm

from qwen35_jax.kernels.prefill_attention import paged_prefill_attention_pallas

T, H, KV, D, PS = int(sys.argv[1]) if len(sys.argv) > 1 else 2048, 16, 4, 256, 16
key = jax.random.key(0)
q = jax.random.normal(key, (1, T, H, D), jnp.bfloat16)
k = jax.random.normal(jax.random.fold_in(key, 1), (1, T, KV, D), jnp.bfloat16)
v = jax.random.normal(jax.random.fold_in(key, 2), (1, T, KV, D), jnp.bfloat16)
# exact fp32 reference
qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
kr, vr = jnp.repeat(kf, H // KV, 2), jnp.repeat(vf, H // KV, 2)
s = jnp.einsum("bthd,bshd->bhts", qf, kr, precision="highest") * D**-0.5
s = jnp.where(jnp.arange(T)[None, None, :, None] >= jnp.arange(T)[None, None, None, :], s, -jnp.inf)
ref = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), vr, precision="highest")
# paged layout for our kernel: one layer, pages in order
pages = T // PS
kp = k.reshape(1, pages, PS, KV, D)[None]
vp = v.reshape(1, pages, PS, KV, D)[None]
kp, vp = kp[:, 0], vp[:, 0]
table = jnp.arange(pages, dtype=jnp.int32)[None]
ours = jax.jit(paged_prefill_attention_pallas)(
    q, kp, vp, jnp.int32(0), table, jnp.zeros(1, jnp.int32), jnp.full(1, T, jnp.int32)
)
for cfg in (dict(block_q=64, block_kv=64, num_stages=2), None):
    op = pm.PallasMosaicGpuFlashAttention(config=pm.ConfigSM90(**cfg) if cfg else None)
    try:
        out = jax.jit(lambda q, k, v, op=op: op(q, k, v, is_causal=True))(q, k, v)
    except Exception as e:
        print("tokamax", cfg, "error", type(e).__name__, str(e)[:400])
        continue
    for name, o in (("tokamax", out), ("ours", ours)):
        err = jnp.abs(o.astype(jnp.float32) - ref)
        print(T, name, cfg, "max abs err", float(err.max()), "mean", float(err.mean()))
    print("tokamax vs ours max diff", float(jnp.abs(out.astype(jnp.float32) - ours.astype(jnp.float32)).max()))
