"""Wall time per product of 16 independent products (distinct weights, one program, 100 calls back to back, best
of 5), the `linear` kernel's tiles against its stream-K schedule, and `norm_linear`'s, at the 4B shapes, batch 1.

    JAX_PLATFORMS=cuda python3 tools/ab_linear_schedules.py 3.0e12 products.json   # HBM copy rate for the floor
"""

import dataclasses, functools, json, sys, time
import jax, jax.numpy as jnp
from qwen35_jax.kernels.linear import LinearTuning, linear_parts_pallas

SHAPES = {
    "gdn_in_proj": (12352, 2560),
    "mlp_gate_up": (18432, 2560),
    "mlp_down": (2560, 9216),
    "out_proj": (2560, 4096),
    "attn_qkv": (10240, 2560),
}
HBM = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0e12


def per_call_us(fn, calls=100):
    for _ in range(10):
        out = fn()
    jax.block_until_ready(out)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


rows = []
key = jax.random.key(0)
fields = {f.name for f in dataclasses.fields(LinearTuning)}
variants = [("tiles", dict(stream=False))]
if "stream" in fields:
    variants += [(f"stream pps={p}", dict(stream=True, programs_per_sm=p)) for p in (2,)]
for batch in (1,):
    for name, (n, k) in SHAPES.items():
        ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 0.02 for i in range(16)]
        x = jax.random.normal(key, (batch, k), jnp.bfloat16)
        for label, kw in variants:
            tuning = LinearTuning(**kw)
            prog = jax.jit(lambda x, ws, t=tuning: [linear_parts_pallas(x, w, tuning=t) for w in ws])
            c = prog.lower(x, ws).compile()
            us = per_call_us(lambda: c(x, ws)) / 16
            floor = n * k * 2 / HBM * 1e6
            rows.append(dict(batch=batch, shape=name, variant=label, us=us, floor_us=floor))
            print(f"b{batch:2d} {name:12s} {label:14s} {us:7.2f} us  floor {floor:6.2f}  {floor / us:6.1%}", flush=True)
        del ws
json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null", "w"), indent=1)

# norm_linear: tiles (bf16 y) against stream (fp32 parts), batch 1, after a 5-part down product
try:
    from qwen35_jax.kernels.norm_linear import norm_linear_parts_pallas
except ImportError:
    norm_linear_parts_pallas = None
from qwen35_jax.kernels.norm_linear import norm_linear_pallas

nrows = []
for name in ("gdn_in_proj", "mlp_gate_up", "attn_qkv"):
    n, k = SHAPES[name]
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 0.02 for i in range(16)]
    h = jax.random.normal(key, (1, k), jnp.bfloat16)
    parts = jax.random.normal(key, (5, 1, k), jnp.float32)
    nw = jnp.zeros((k,), jnp.bfloat16)
    fns = [("norm tiles", norm_linear_pallas)]
    if norm_linear_parts_pallas is not None:
        fns.append(("norm stream", norm_linear_parts_pallas))
    for label, f in fns:
        prog = jax.jit(lambda h, parts, ws, f=f: [f(h, parts, nw, w, 1e-6) for w in ws])
        c = prog.lower(h, parts, ws).compile()
        us = per_call_us(lambda: c(h, parts, ws)) / 16
        floor = n * k * 2 / HBM * 1e6
        print(f"b 1 {name:12s} {label:14s} {us:7.2f} us  floor {floor:6.2f}  {floor / us:6.1%}", flush=True)
        rows.append(dict(batch=1, shape=name, variant=label, us=us, floor_us=floor))
    del ws
json.dump(rows, open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null", "w"), indent=1)
