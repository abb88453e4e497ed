"""GDN one-token decode: the Pallas in-pool kernel against `gdn_decode_ref` / `gdn_decode_pool_ref`, in interpret mode
on the CPU and compiled on the GPU (`-m gpu`), with the state carried across consecutive steps the way the engine
carries it.

Tolerances:
- The state is fp32 on both sides whatever the input dtype, and both compute the same fp32 expressions; they
  differ only in the order of the dk-term sums (S^T k, the l2norms) and in rsqrt/exp rounding: measured
  <= 5e-7 on |S| ~ 2 after six steps (a few ulp). atol = rtol = 1e-5 leaves 20x headroom and is still far
  below any real mistake (a wrong key head, a missing decay or scale moves S by O(0.1..1)). The error does
  not grow with steps: with |k| = 1 and beta in (0, 1) the update (I - beta k k^T) exp(g) is a contraction.
- o in fp32: |o| ~ 0.1 (q is unit-norm and scaled by dk^-0.5); same fp32 argument, atol 1e-6, rtol 1e-5.
- o in bf16: both sides round the same fp32 value to bf16, and a last-ulp fp32 difference can flip that
  rounding: one bf16 ulp is 2^-8 relative, so rtol 2^-7 with atol 1e-5 for values near zero.

The first tests run the kernel on one-layer pools whose slots are the batch's rows in order, against
`gdn_decode_ref` on the same states; the pool tests below against `gdn_decode_pool_ref`, with the same
tolerances for o and for the rows the step writes. Exact checks: pool rows the step does not write come
back bit-identical (the kernel never stores to them; a wrong layer, slot or column offset would overwrite
one), and `gdn_decode_pool_ref` is bit-for-bit gather + `gdn_decode_ref` + scatter (same ops, same inputs).
Padding rows point at the trash slot (the pool's last) and are skipped: their o is exactly 0 on both sides, and
the trash slot comes back bit-identical.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels.gdn_decode import (
    GDN_DECODE_TUNING,
    gated_rms_norm,
    gdn_decode_pool_gated_pallas,
    gdn_decode_pool_gated_ref,
    gdn_decode_pool_packed_pallas,
    gdn_decode_pool_packed_ref,
    gdn_decode_pool_pallas,
    gdn_decode_pool_ref,
    gdn_decode_ref,
    gdn_gates,
)

BLOCK_DV = GDN_DECODE_TUNING.block_dv

STATE_TOL = dict(atol=1e-5, rtol=1e-5)
OUT_TOL = {jnp.float32: dict(atol=1e-6, rtol=1e-5), jnp.bfloat16: dict(atol=1e-5, rtol=2**-7)}


def step_inputs(key, batch, nk, nv, dk, dv, dtype):
    """One decode step's q, k [B, nk, dk], v [B, nv, dv], g [B, nv] (fp32, < 0) and beta [B, nv] in (0, 1)."""
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = jax.random.normal(kq, (batch, nk, dk)).astype(dtype)
    k = jax.random.normal(kk, (batch, nk, dk)).astype(dtype)
    v = jax.random.normal(kv, (batch, nv, dv)).astype(dtype)
    g = -jnp.exp(jax.random.uniform(kg, (batch, nv), minval=-5.0, maxval=1.0))  # decay exp(g) in (0.07, 0.993)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (batch, nv))).astype(dtype)
    return q, k, v, g, beta


def rows_step(q, k, v, g, beta, state, interpret=True):
    """The kernel on states [B, nv, dk, dv] as the one-layer pool state[None], row b in slot b (no trash slot)."""
    slots = jnp.arange(state.shape[0], dtype=jnp.int32)
    out, pool = gdn_decode_pool_pallas(q, k, v, g, beta, state[None], 0, slots, None, interpret=interpret)
    return out, pool[0]


pallas_step = jax.jit(rows_step)


def run_steps(batch, nk, nv, dk, dv, dtype, steps, seed=0):
    """Both implementations from the same random state, each fed its own output state; checks every step."""
    state = 0.5 * jax.random.normal(jax.random.PRNGKey(seed), (batch, nv, dk, dv), jnp.float32)
    kernel_state, ref_state = state, state
    for step in range(steps):
        inputs = step_inputs(jax.random.PRNGKey(seed * 100 + step + 1), batch, nk, nv, dk, dv, dtype)
        out, kernel_state = pallas_step(*inputs, kernel_state)
        ref_out, ref_state = gdn_decode_ref(*inputs, ref_state)
        assert out.dtype == dtype and out.shape == (batch, nv, dv)
        assert kernel_state.dtype == jnp.float32 and kernel_state.shape == state.shape
        np.testing.assert_allclose(np.float32(out), np.float32(ref_out), **OUT_TOL[dtype], err_msg=f"o, step {step}")
        np.testing.assert_allclose(kernel_state, ref_state, **STATE_TOL, err_msg=f"state, step {step}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch, nk, nv, dk, dv",
    [(1, 1, 1, 16, 16), (3, 2, 4, 16, 64), (8, 2, 2, 32, 32), (3, 1, 4, 64, 16)],
    ids=["single", "ratio2-dv-split", "ratio1", "ratio4"],
)
def test_small_shapes_match_ref(batch, nk, nv, dk, dv, dtype):
    run_steps(batch, nk, nv, dk, dv, dtype, steps=3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nv", [4, 2], ids=["ratio2", "ratio1"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_real_head_dims_match_ref_over_steps(batch, nv, dtype):
    """dk = dv = 128 as in every Qwen3.5 size; four consecutive steps carrying the state."""
    run_steps(batch, 2, nv, 128, 128, dtype, steps=4, seed=batch)


def test_fresh_state_first_step():
    """A new sequence starts from zeros: S = beta k v^T, so o = beta (q . k) v exactly."""
    q, k, v, g, beta = step_inputs(jax.random.PRNGKey(7), 2, 2, 4, 32, 32, jnp.float32)
    out, state = pallas_step(q, k, v, g, beta, jnp.zeros((2, 4, 32, 32)))
    qn = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * 32**-0.5
    kn = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    qk = jnp.repeat(jnp.sum(qn * kn, axis=-1), 2, axis=1)  # [B, nv]: value head j reads key head j // 2
    np.testing.assert_allclose(out, (beta * qk)[..., None] * v, atol=1e-6, rtol=1e-5)
    expected_state = jnp.repeat(kn, 2, axis=1)[..., :, None] * (beta[..., None] * v)[..., None, :]
    np.testing.assert_allclose(state, expected_state, atol=1e-6, rtol=1e-5)


def pallas_calls(jaxpr):
    """Every pallas_call equation in a jaxpr, nested jaxprs (jit, cond, ...) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from pallas_calls(inner)


def h200_inputs(batch=4, nk=16, nv=32, dk=128, dv=128, dtype=jnp.bfloat16):
    shapes = [(batch, nk, dk), (batch, nk, dk), (batch, nv, dv), (batch, nv), (batch, nv), (batch, nv, dk, dv)]
    dtypes = [dtype, dtype, dtype, jnp.float32, dtype, jnp.float32]
    return [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 256])
def test_gpu_compiled_matches_ref_at_4b_shapes(batch):
    """The compiled kernel at Qwen3.5-4B shapes (nk 16, nv 32, dk = dv = 128), bf16, three steps carried."""
    nk, nv, dk, dv = 16, 32, 128, 128
    step = jax.jit(lambda *a: rows_step(*a, interpret=False))
    ref_step = jax.jit(gdn_decode_ref)
    state = ref_state = 0.5 * jax.random.normal(jax.random.PRNGKey(0), (batch, nv, dk, dv), jnp.float32)
    for i in range(3):
        inputs = step_inputs(jax.random.PRNGKey(i + 1), batch, nk, nv, dk, dv, jnp.bfloat16)
        out, state = step(*inputs, state)
        ref_out, ref_state = ref_step(*inputs, ref_state)
        np.testing.assert_allclose(np.float32(out), np.float32(ref_out), **OUT_TOL[jnp.bfloat16])
        np.testing.assert_allclose(np.asarray(state), np.asarray(ref_state), **STATE_TOL)


# ---- in-pool decode: the step's rows updated inside the [L, S, nv, dk, dv] slot pool ---------------------------

POOL_LAYERS = 3


def pool_case(rng, batch, nv, dk, dv):
    """A random pool [POOL_LAYERS, batch + 3, nv, dk, dv]: `batch` rows' distinct slots in shuffled order, two
    slots no row uses and the trash slot (the last), which padding rows share."""
    num_slots = batch + 3
    pool = jnp.asarray(0.5 * rng.standard_normal((POOL_LAYERS, num_slots, nv, dk, dv), dtype=np.float32))
    return pool, rng.permutation(num_slots - 1)[:batch], num_slots - 1


# A bf16 pool: kernel and reference compute the step in fp32 from the same stored state and round the new state to
# bf16 once. Their fp32 values differ by op order only (~1e-6 relative, STATE_TOL), so a rounded element differs
# at most when its value sits at a rounding boundary, and then by one bf16 ulp: at most 2^-7 of the value.
BF16_POOL_TOL = dict(atol=1e-6, rtol=2**-7)


def run_pool_steps(batch, nk, nv, dk, dv, dtype, layers, padding=0, block_dv=None, seed=0, pool_dtype=jnp.float32):
    """Kernel (interpret mode, jitted so that `layer` is traced) and reference each carry their own pool through
    one step per entry of `layers`; rows arrive in a new order every step, `padding` rows at the trash slot. With a
    bf16 pool the reference steps from the kernel's pool, so that one step's rounding is compared at a time."""
    rng = np.random.default_rng(seed)
    pool, real, trash = pool_case(rng, batch, nv, dk, dv)
    pool = pool.astype(pool_dtype)
    tuning = dataclasses.replace(GDN_DECODE_TUNING, block_dv=block_dv) if block_dv else GDN_DECODE_TUNING
    kernel_step = jax.jit(lambda *a: gdn_decode_pool_pallas(*a, interpret=True, tuning=tuning))
    kernel_pool = ref_pool = pool
    for step, layer in enumerate(layers):
        slots = jnp.asarray(np.concatenate([rng.permutation(real), np.full(padding, trash)]), jnp.int32)
        inputs = step_inputs(jax.random.PRNGKey(seed * 100 + step + 1), batch + padding, nk, nv, dk, dv, dtype)
        out, new_pool = kernel_step(*inputs, kernel_pool, jnp.int32(layer), slots)
        ref_from = ref_pool if pool_dtype == jnp.float32 else kernel_pool
        ref_out, ref_pool = gdn_decode_pool_ref(*inputs, ref_from, jnp.int32(layer), slots)
        assert out.dtype == dtype and out.shape == (batch + padding, nv, dv)
        assert new_pool.dtype == pool_dtype and new_pool.shape == pool.shape
        written = np.zeros(pool.shape[:2], bool)
        written[layer, np.asarray(slots[:batch])] = True  # the padding rows skip the trash slot
        new, old = np.asarray(new_pool), np.asarray(kernel_pool)
        np.testing.assert_array_equal(
            new[~written], old[~written], err_msg=f"rows the step does not write, step {step}"
        )
        np.testing.assert_array_equal(np.float32(out[batch:]), 0.0, err_msg=f"padding rows' o, step {step}")
        np.testing.assert_array_equal(np.float32(ref_out[batch:]), 0.0, err_msg=f"padding rows' ref o, step {step}")
        np.testing.assert_allclose(np.float32(out[:batch]), np.float32(ref_out[:batch]), **OUT_TOL[dtype],
                                   err_msg=f"o, step {step}")  # fmt: skip
        tol = STATE_TOL if pool_dtype == jnp.float32 else BF16_POOL_TOL
        np.testing.assert_allclose(np.float32(new), np.float32(ref_pool), **tol, err_msg=f"pool, step {step}")
        kernel_pool = new_pool


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch, nk, nv, dk, dv, block_dv, padding",
    [(3, 2, 4, 16, 64, 16, 0), (4, 1, 4, 32, 32, None, 2), (5, 2, 4, 128, 128, None, 0), (3, 2, 2, 128, 128, None, 1)],
    ids=["ratio2-dv-split-4", "ratio4-padding", "head-dims-128", "head-dims-128-ratio1-padding"],
)
def test_pool_matches_ref_over_steps(batch, nk, nv, dk, dv, block_dv, padding, dtype):
    """Four steps at layers 1, 2, 2, 0: non-zero layers, the same rows carried twice in a row, and layer 0."""
    run_pool_steps(batch, nk, nv, dk, dv, dtype, layers=[1, 2, 2, 0], padding=padding, block_dv=block_dv, seed=batch)


@pytest.mark.parametrize("batch, nk, nv, dk, dv, padding", [(3, 2, 4, 16, 64, 0), (3, 2, 2, 128, 128, 1)],
                         ids=["ratio2-dv-split", "head-dims-128-padding"])  # fmt: skip
def test_bf16_pool_matches_ref_step_by_step(batch, nk, nv, dk, dv, padding):
    """`--mamba-ssm-cache-dtype bfloat16`: the pool stays bf16, rows the step does not write stay bit-identical, and
    each step's new state is the reference's within one bf16 rounding."""
    run_pool_steps(batch, nk, nv, dk, dv, jnp.bfloat16, layers=[1, 2, 0], padding=padding, seed=batch,
                   pool_dtype=jnp.bfloat16)  # fmt: skip


@pytest.mark.gpu
def test_gpu_bf16_pool_at_4b_shapes_matches_ref():
    """The compiled kernel on a bf16 pool at Qwen3.5-4B shapes, batch 64 with 2 padding rows, three steps."""
    rng = np.random.default_rng(21)
    batch, nk, nv, dk, dv, padding = 62, 16, 32, 128, 128, 2
    pool, real, trash = pool_case(rng, batch, nv, dk, dv)
    pool = pool.astype(jnp.bfloat16)
    kernel = jax.jit(gdn_decode_pool_pallas)
    for step, layer in enumerate([1, 2, 0]):
        slots = jnp.asarray(np.concatenate([rng.permutation(real), np.full(padding, trash)]), jnp.int32)
        inputs = step_inputs(jax.random.PRNGKey(step + 30), batch + padding, nk, nv, dk, dv, jnp.bfloat16)
        out, new_pool = kernel(*inputs, pool, jnp.int32(layer), slots)
        ref_out, ref_pool = gdn_decode_pool_ref(*inputs, pool, jnp.int32(layer), slots)
        assert new_pool.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(out), np.float32(ref_out), **OUT_TOL[jnp.bfloat16])
        np.testing.assert_allclose(np.float32(new_pool), np.float32(ref_pool), **BF16_POOL_TOL)
        pool = new_pool


def test_a_bf16_pool_keeps_the_math_in_fp32():
    """The bf16 pool's step is the fp32 step on the stored state, rounded once: bit for bit the fp32 pool's step on
    the same (bf16-valued) state, its new state rounded to bf16 (a step computed in bf16 would differ)."""
    rng = np.random.default_rng(5)
    pool, real, _ = pool_case(rng, 3, 4, 128, 128)
    pool = pool.astype(jnp.bfloat16)
    slots = jnp.asarray(real, jnp.int32)
    inputs = step_inputs(jax.random.PRNGKey(6), 3, 2, 4, 128, 128, jnp.bfloat16)
    kernel = jax.jit(lambda *a: gdn_decode_pool_pallas(*a, interpret=True))
    out16, pool16 = kernel(*inputs, pool, 1, slots)
    out32, pool32 = kernel(*inputs, pool.astype(jnp.float32), 1, slots)
    np.testing.assert_array_equal(np.float32(out16), np.float32(out32))
    np.testing.assert_array_equal(np.float32(pool16), np.float32(pool32.astype(jnp.bfloat16)))


@pytest.mark.parametrize(
    "nk, nv, dk, dv",
    [(2, 4, 16, 16), (2, 2, 128, 128), (2, 4, 16, 32)],
    ids=["ratio2", "head-dims-128-ratio1", "dk-ne-dv-slices"],
)
def test_packed_reads_q_k_v_from_the_conv_output(nk, nv, dk, dv):
    """The packed entry point on [q | k | v] side by side equals the pool kernel on the three slices, bit for bit
    (the same programs on the same values; a wrong head offset into the packed rows reads another head), and the
    packed reference equals the pool reference; padding rows included."""
    rng = np.random.default_rng(11)
    pool, real, trash = pool_case(rng, 3, nv, dk, dv)
    slots = jnp.asarray(np.concatenate([rng.permutation(real), [trash]]), jnp.int32)
    q, k, v, g, beta = step_inputs(jax.random.PRNGKey(12), 4, nk, nv, dk, dv, jnp.bfloat16)
    qkv = jnp.concatenate([q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1)], axis=-1)
    packed = jax.jit(lambda *a: gdn_decode_pool_packed_pallas(*a, interpret=True))(qkv, g, beta, pool, 1, slots)
    apart = jax.jit(lambda *a: gdn_decode_pool_pallas(*a, interpret=True))(q, k, v, g, beta, pool, 1, slots)
    for got, want in zip(packed, apart, strict=True):
        np.testing.assert_array_equal(np.float32(got), np.float32(want))
    for got, want in zip(gdn_decode_pool_packed_ref(qkv, g, beta, pool, 1, slots),
                         gdn_decode_pool_ref(q, k, v, g, beta, pool, 1, slots), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.float32(got), np.float32(want))


def test_pool_ref_is_gather_ref_scatter():
    """`gdn_decode_pool_ref` is exactly gdn_decode_ref on pool[layer][slots], written back to those rows (numpy
    gather and scatter here); a wrong layer or slot order changes whole rows."""
    rng = np.random.default_rng(3)
    pool = 0.5 * rng.standard_normal((POOL_LAYERS, 7, 4, 16, 32), dtype=np.float32)
    layer, slots = 2, np.array([5, 0, 3], np.int32)
    inputs = step_inputs(jax.random.PRNGKey(4), 3, 2, 4, 16, 32, jnp.bfloat16)
    out, new_pool = gdn_decode_pool_ref(*inputs, jnp.asarray(pool), jnp.int32(layer), jnp.asarray(slots))
    expected_out, rows = gdn_decode_ref(*inputs, jnp.asarray(pool[layer][slots]))
    expected_pool = pool.copy()
    expected_pool[layer, slots] = np.asarray(rows)
    np.testing.assert_array_equal(np.float32(out), np.float32(expected_out))
    np.testing.assert_array_equal(np.asarray(new_pool), expected_pool)


def test_pool_wrapper_holds_no_nested_jit():
    """Only lax primitives around the pallas_call (the model may call it inside stream-annotated regions, where
    a nested jit fails at run time), and the pool (operand 7) is aliased to the new pool (result 1)."""
    shape = jax.ShapeDtypeStruct
    jaxpr = jax.make_jaxpr(lambda *a: gdn_decode_pool_pallas(*a, interpret=True))(
        *h200_inputs(batch=3, nk=2, nv=4, dk=16, dv=32)[:5], shape((POOL_LAYERS, 5, 4, 16, 32), jnp.float32),
        shape((), jnp.int32), shape((3,), jnp.int32),
    )  # fmt: skip
    names = [eqn.primitive.name for eqn in jaxpr.eqns]
    assert "pallas_call" in names and not {"jit", "pjit", "closed_call"} & set(names), names
    [call] = list(pallas_calls(jaxpr.jaxpr))
    assert tuple(call.params["input_output_aliases"]) == ((7, 1),)


def triton_modules(lowered) -> list[str]:
    """The Triton IR of every pallas_call in a lowered program, as MLIR text. The custom call carries it as MLIR
    bytecode; reading it back needs a context with jaxlib's Triton dialect, which the Pallas lowering uses too
    (private jax/jaxlib modules: there is no public way to read this IR)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as triton_dialect

    blobs = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    attributes = inner.operation.attributes
                    if (inner.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(attributes["call_target_name"]).value == "__gpu$xla.gpu.triton"):  # fmt: skip
                        blobs.append(ir.StringAttr(ir.DictAttr(attributes["mhlo.backend_config"])["ir"]).value_bytes)
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    context = mlir.make_ir_context()
    triton_dialect.register_dialect(context)
    context.load_all_available_dialects()
    with context:
        return [str(ir.Module.parse(blob)) for blob in blobs]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize(
    "num_slots, pool_dtype, offset_bits",
    [(257, jnp.float32, 64), (5, jnp.float32, 32), (257, jnp.bfloat16, 64)],
    ids=["pool-12.9GB", "pool-250MB", "bf16-pool-6.5GB"],
)
def test_pool_lowers_to_triton_for_h200(num_slots, pool_dtype, offset_bits):
    """4B shapes at batch 64 and a pool [24, num_slots, 32, 128, 128] fp32 given abstractly (nothing is allocated).
    The 4B pool at 256 slots + trash (3.4e9 elements, 12.9 GB) must be addressed with 64-bit offsets: both pool
    accesses (the tile's load from the input and its store to the aliased output) add an i64 offset tensor to
    the pool pointer, and layer and slot are multiplied by their strides (num_slots * 32 * 128 * 128 and
    32 * 128 * 128 elements) in i64. The 250 MB pool is the control that shows the check tells them apart: there
    the lowering keeps int32 offsets. A bf16 pool of 257 slots (6.5 GB) is still past 2^32 bytes. Checks the pool
    alias (operand 7 -> result 1) and the grid too."""
    batch, nv, dk, dv = 64, 32, 128, 128
    args = [*h200_inputs(batch=batch)[:5], jax.ShapeDtypeStruct((24, num_slots, nv, dk, dv), pool_dtype),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)]  # fmt: skip
    lowered = lower_for_h200(gdn_decode_pool_pallas, *args)
    text = lowered.as_text()
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 7" in text
    assert re.findall(r"grid_[xyz] = (\d+)", text) == [str(batch), str(nv), str(dv // BLOCK_DV)]
    [triton] = triton_modules(lowered)
    tile = f"{dk}x{BLOCK_DV}"
    element = "f32" if pool_dtype == jnp.float32 else "bf16"
    pool_offsets = re.findall(rf"tt\.addptr .* : tensor<{tile}x!tt\.ptr<{element}>>, tensor<{tile}xi(\d+)>", triton)
    assert pool_offsets == [str(offset_bits)] * 2, pool_offsets
    for stride in (num_slots * nv * dk * dv, nv * dk * dv):  # layer, slot
        assert f"arith.constant {stride} : i{offset_bits}" in triton, stride


@jax.jit
def pools_agree(pool, ref_pool, written):
    """On the device (the pools are 12.9 GB each): (rows never written are bit-identical, every row is within
    STATE_TOL); written is an [L, S] mask."""
    same = jnp.all((pool == ref_pool) | written[:, :, None, None, None])
    close = jnp.abs(pool - ref_pool) <= STATE_TOL["atol"] + STATE_TOL["rtol"] * jnp.abs(ref_pool)
    return same, jnp.all(close)


@pytest.mark.gpu
def test_gpu_pool_over_2_31_elements_matches_ref():
    """The compiled in-pool kernel at 4B shapes on the 4B pool at 256 slots + trash: [24, 257, 32, 128, 128] fp32,
    3.4e9 elements (12.9 GB), past 2^31, so int32 element offsets would wrap for the upper rows. Batch 64: 62
    real rows, half in the lowest and half in the highest slots, in shuffled order, and 2 padding rows at the
    trash slot (skipped: it must come back as it was); three bf16 steps at layers 23, 11, 23 (layer 23 holds the highest addresses). Kernel and
    reference each carry their own donated pool: 2 x 12.9 GB plus the random fill's temporaries, well within
    the H200's memory."""
    layers, num_slots, batch, nk, nv, dk, dv = 24, 257, 64, 16, 32, 128, 128
    trash = num_slots - 1
    rng = np.random.default_rng(0)
    real = rng.permutation(np.concatenate([np.arange(31), np.arange(trash - 31, trash)]))
    slots = jnp.asarray(np.concatenate([real, [trash, trash]]), jnp.int32)
    pool = jax.jit(lambda key: 0.5 * jax.random.normal(key, (layers, num_slots, nv, dk, dv), jnp.float32))(
        jax.random.PRNGKey(0)
    )
    assert pool.size > 2**31
    ref_pool = jnp.copy(pool)
    step = jax.jit(gdn_decode_pool_pallas, donate_argnums=5)
    ref_step = jax.jit(gdn_decode_pool_ref, donate_argnums=5)
    written = np.zeros((layers, num_slots), bool)
    for i, layer in enumerate([23, 11, 23]):
        inputs = step_inputs(jax.random.PRNGKey(i + 1), batch, nk, nv, dk, dv, jnp.bfloat16)
        out, pool = step(*inputs, pool, jnp.int32(layer), slots)
        with jax.default_matmul_precision("highest"):  # IEEE fp32 einsums in the reference, as in the kernel
            ref_out, ref_pool = ref_step(*inputs, ref_pool, jnp.int32(layer), slots)
        written[layer, real] = True
        np.testing.assert_allclose(np.float32(out[:62]), np.float32(ref_out[:62]), **OUT_TOL[jnp.bfloat16])
        np.testing.assert_array_equal(np.float32(out[62:]), 0.0)  # the padding rows, skipped
        rows = jnp.asarray(real)
        np.testing.assert_allclose(np.asarray(pool[layer, rows]), np.asarray(ref_pool[layer, rows]), **STATE_TOL)
        same, close = pools_agree(pool, ref_pool, jnp.asarray(written))
        assert bool(same), f"rows never written changed, step {i}"
        assert bool(close), f"pool rows outside STATE_TOL, step {i}"


@pytest.mark.gpu
def test_gpu_pool_donated_updated_in_place():
    """With the pool donated, the new pool lives in the input's buffer: the step writes only its rows, no copy."""
    inputs = step_inputs(jax.random.PRNGKey(1), 8, 16, 32, 128, 128, jnp.bfloat16)
    pool = jnp.ones((2, 9, 32, 128, 128), jnp.float32)
    pointer = pool.unsafe_buffer_pointer()
    slots = jnp.asarray([7, 0, 3, 5, 1, 6, 2, 4], jnp.int32)
    _, new_pool = jax.jit(gdn_decode_pool_pallas, donate_argnums=5)(*inputs, pool, jnp.int32(1), slots)
    assert pool.is_deleted()
    assert new_pool.unsafe_buffer_pointer() == pointer


def gated_inputs(rng, batch, nv, dtype, ba_col=5):
    """The in_proj's b and a at columns [ba_col, ba_col + 2 nv) of a wider row (other columns before and after, as
    in the fused product), and the layer's A_log and dt_bias."""
    ba = jnp.asarray(rng.standard_normal((batch, ba_col + 2 * nv + 3)), dtype)
    a_log = jnp.asarray(rng.uniform(-1.0, 1.5, nv), dtype)
    dt_bias = jnp.asarray(rng.standard_normal(nv), dtype)
    return ba, ba_col, a_log, dt_bias


def test_gdn_gates_are_hf_s_formula():
    """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), written with exp and log1p (so that the kernel
    can make them too), against jax.nn's softplus and sigmoid over a wide range of a."""
    a = jnp.linspace(-40.0, 40.0, 1001)
    b = jnp.linspace(-30.0, 30.0, 1001)
    a_log, dt_bias = jnp.float32(0.7), jnp.float32(-0.3)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    np.testing.assert_allclose(g, -jnp.exp(a_log) * jax.nn.softplus(a + dt_bias), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(beta, jax.nn.sigmoid(b), rtol=1e-6, atol=1e-30)
    assert gdn_gates(a, b.astype(jnp.bfloat16), a_log, dt_bias)[1].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nk, nv, dk, dv", [(2, 4, 16, 16), (2, 4, 16, 32)], ids=["packed", "dk-ne-dv"])
def test_gated_kernel_makes_the_gates_from_the_in_proj_columns(dtype, nk, nv, dk, dv):
    """The gated entry point reads b and a at their columns of the in_proj's output and makes the gates in the
    kernel: it equals the gated reference (`gdn_gates` of the same columns, then the packed reference), padding rows
    included; the columns around them hold other values, so a wrong offset or head fails the comparison."""
    rng = np.random.default_rng(21)
    pool, real, trash = pool_case(rng, 3, nv, dk, dv)
    slots = jnp.asarray(np.concatenate([rng.permutation(real), [trash]]), jnp.int32)
    q, k, v, _, _ = step_inputs(jax.random.PRNGKey(22), 4, nk, nv, dk, dv, dtype)
    qkv = jnp.concatenate([q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1)], axis=-1)
    ba, ba_col, a_log, dt_bias = gated_inputs(rng, 4, nv, dtype)
    kernel = jax.jit(lambda *a: gdn_decode_pool_gated_pallas(*a, interpret=True), static_argnums=2)
    out, new_pool = kernel(qkv, ba, ba_col, a_log, dt_bias, pool, 1, slots)
    ref_out, ref_pool = gdn_decode_pool_gated_ref(qkv, ba, ba_col, a_log, dt_bias, pool, 1, slots)
    np.testing.assert_allclose(np.float32(out), np.float32(ref_out), **OUT_TOL[dtype])
    np.testing.assert_allclose(np.float32(new_pool), np.float32(ref_pool), **STATE_TOL)
    assert not np.any(np.float32(out)[-1]), "the padding row's output is 0"
    g, beta = gdn_gates(ba[:, ba_col + nv : ba_col + 2 * nv], ba[:, ba_col : ba_col + nv], a_log, dt_bias)
    np.testing.assert_array_equal(np.float32(ref_out), np.float32(gdn_decode_pool_packed_ref(qkv, g, beta, pool, 1,
                                                                                              slots)[0]))  # fmt: skip


# The output norm after the step: o, computed in a different order, can round one bf16 step apart on each side of
# a rounding boundary; the norm's scale, its weight product and its silu(z) product each round once more, so up to
# four steps of 2^-7 (2^-5 relative) in bf16, fp32 rounding alone (OUT_TOL) in fp32. A wrong z column, head or
# weight moves values by O(1).
NORMED_OUT_TOL = {jnp.float32: OUT_TOL[jnp.float32], jnp.bfloat16: dict(atol=1e-5, rtol=2**-5)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "dk, block_dv", [(32, 32), (32, 16), (16, 32)], ids=["norm-in-kernel", "norm-after", "dk-ne-dv"]
)
def test_gated_kernel_applies_the_output_norm(dtype, dk, block_dv):
    """With norm_weight, the gated entry point returns o through the output norm, the gate z read at columns [z_col,
    z_col + nv dv) of a wider product with more rows than the step's (as the model hands it and b, a over): in the
    kernel when a program holds a head's whole o (block_dv = dv), after it otherwise (and after the unpacked kernel that
    head dims that differ take). All equal the normed reference, and that is `gated_rms_norm` of the plain
    reference's o; the padding row stays 0."""
    rng = np.random.default_rng(23)
    nk, nv, dv = 2, 4, 32
    pool, real, trash = pool_case(rng, 3, nv, dk, dv)
    slots = jnp.asarray(np.concatenate([rng.permutation(real), [trash]]), jnp.int32)
    q, k, v, _, _ = step_inputs(jax.random.PRNGKey(24), 4, nk, nv, dk, dv, dtype)
    qkv = jnp.concatenate([q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1)], axis=-1)
    ba, ba_col, a_log, dt_bias = gated_inputs(rng, 6, nv, dtype)  # 2 rows more too (the prefill rows')
    z_col = 2 * dv
    product = jnp.asarray(rng.standard_normal((6, z_col + nv * dv + 7)), dtype)  # 2 rows more, columns around z
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(dv), dtype)
    norm = dict(z=product, z_col=z_col, norm_weight=weight, eps=1e-6)
    tuning = dataclasses.replace(GDN_DECODE_TUNING, block_dv=block_dv)
    kernel = jax.jit(lambda *a, **kw: gdn_decode_pool_gated_pallas(*a, interpret=True, tuning=tuning, **kw),
                     static_argnames=("ba_col", "z_col", "eps"))  # fmt: skip
    out, new_pool = kernel(qkv, ba, pool=pool, layer=1, slots=slots, ba_col=ba_col, a_log=a_log, dt_bias=dt_bias,
                           **norm)  # fmt: skip
    ref_out, ref_pool = gdn_decode_pool_gated_ref(qkv, ba, ba_col, a_log, dt_bias, pool, 1, slots, **norm)
    np.testing.assert_allclose(np.float32(out), np.float32(ref_out), **NORMED_OUT_TOL[dtype])
    np.testing.assert_allclose(np.float32(new_pool), np.float32(ref_pool), **STATE_TOL)
    assert not np.any(np.float32(out)[-1]), "the padding row's output is 0"
    plain, _ = gdn_decode_pool_gated_ref(qkv, ba, ba_col, a_log, dt_bias, pool, 1, slots)
    z = product[:4, z_col : z_col + nv * dv].reshape(4, nv, dv)
    np.testing.assert_array_equal(np.float32(ref_out), np.float32(gated_rms_norm(plain, weight, z, 1e-6)))
    assert np.abs(np.float32(ref_out) - np.float32(plain)).max() > 0.1  # the norm did something


def test_gated_rms_norm_is_hf_s_order():
    """HF's RMSNormGated: the normalised x rounded to its dtype, times the weight (not zero-centred), rounded, times
    silu(z) in fp32, rounded; a zero x gives 0."""
    rng = np.random.default_rng(25)
    x, z = (jnp.asarray(rng.standard_normal((3, 16)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(16), jnp.bfloat16)
    x32 = np.float32(x)
    normed = jnp.asarray(x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6), jnp.bfloat16)
    scaled = jnp.asarray(np.float32(w) * np.float32(normed), jnp.bfloat16)
    z32 = np.float32(z)
    want = jnp.asarray(np.float32(scaled) * z32 / (1 + np.exp(-z32)), jnp.bfloat16)
    got = gated_rms_norm(x, w, z, 1e-6)
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=1e-6, rtol=2**-7)  # numpy's sqrt/exp order
    assert not np.any(np.float32(gated_rms_norm(jnp.zeros_like(x), w, z, 1e-6)))
