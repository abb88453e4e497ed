"""GDN one-token decode: the Pallas kernel against `gdn_decode_ref`, in interpret mode on the CPU and compiled on
the GPU (`-m gpu`), with the state carried across consecutive steps the way the engine carries it.

Tolerances:
- The state is fp32 on both sides whatever the input dtype, and both compute the same fp32 expressions; they
  differ only in the order of the dk-term sums (S^T k, the l2norms) and in rsqrt/exp rounding: measured
  <= 5e-7 on |S| ~ 2 after six steps (a few ulp). atol = rtol = 1e-5 leaves 20x headroom and is still far
  below any real mistake (a wrong key head, a missing decay or scale moves S by O(0.1..1)). The error does
  not grow with steps: with |k| = 1 and beta in (0, 1) the update (I - beta k k^T) exp(g) is a contraction.
- o in fp32: |o| ~ 0.1 (q is unit-norm and scaled by dk^-0.5); same fp32 argument, atol 1e-6, rtol 1e-5.
- o in bf16: both sides round the same fp32 value to bf16, and a last-ulp fp32 difference can flip that
  rounding: one bf16 ulp is 2^-8 relative, so rtol 2^-7 with atol 1e-5 for values near zero.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.kernels.gdn_decode import BLOCK_DV, gdn_decode_pallas, gdn_decode_ref

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


def run_steps(batch, nk, nv, dk, dv, dtype, steps, seed=0):
    """Both implementations from the same random state, each fed its own output state; checks every step."""
    state = 0.5 * jax.random.normal(jax.random.PRNGKey(seed), (batch, nv, dk, dv), jnp.float32)
    kernel_state, ref_state = state, state
    for step in range(steps):
        inputs = step_inputs(jax.random.PRNGKey(seed * 100 + step + 1), batch, nk, nv, dk, dv, dtype)
        out, kernel_state = gdn_decode_pallas(*inputs, kernel_state, interpret=True)
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
    out, state = gdn_decode_pallas(q, k, v, g, beta, jnp.zeros((2, 4, 32, 32)), interpret=True)
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


def test_state_aliased_in_place():
    """The state input (operand 5) is the state output (result 1), so XLA can update the pool rows in place."""
    jaxpr = jax.make_jaxpr(gdn_decode_pallas)(*h200_inputs()).jaxpr
    [call] = list(pallas_calls(jaxpr))
    assert tuple(call.params["input_output_aliases"]) == ((5, 1),)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200():
    """The Triton lowering runs on the CPU for an abstract H200: it rejects what Triton cannot take (tensor sizes
    that are not powers of two, unsupported primitives). Checks the aliasing and the (B, nv, dv/BLOCK_DV) grid too."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        text = jax.jit(gdn_decode_pallas).trace(*h200_inputs()).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 5" in text
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["4", "32", str(128 // BLOCK_DV)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 256])
def test_gpu_compiled_matches_ref_at_4b_shapes(batch):
    """The compiled kernel at Qwen3.5-4B shapes (nk 16, nv 32, dk = dv = 128), bf16, three steps carried."""
    nk, nv, dk, dv = 16, 32, 128, 128
    step = jax.jit(gdn_decode_pallas)
    ref_step = jax.jit(gdn_decode_ref)
    state = ref_state = 0.5 * jax.random.normal(jax.random.PRNGKey(0), (batch, nv, dk, dv), jnp.float32)
    for i in range(3):
        inputs = step_inputs(jax.random.PRNGKey(i + 1), batch, nk, nv, dk, dv, jnp.bfloat16)
        out, state = step(*inputs, state)
        ref_out, ref_state = ref_step(*inputs, ref_state)
        np.testing.assert_allclose(np.float32(out), np.float32(ref_out), **OUT_TOL[jnp.bfloat16])
        np.testing.assert_allclose(np.asarray(state), np.asarray(ref_state), **STATE_TOL)


@pytest.mark.gpu
def test_gpu_donated_state_updated_in_place():
    """With the state donated, the new state lives in the input's buffer: no copy of the [B, nv, dk, dv] pool."""
    inputs = step_inputs(jax.random.PRNGKey(1), 8, 16, 32, 128, 128, jnp.bfloat16)
    state = jnp.ones((8, 32, 128, 128), jnp.float32)
    pointer = state.unsafe_buffer_pointer()
    _, new_state = jax.jit(gdn_decode_pallas, donate_argnums=5)(*inputs, state)
    assert state.is_deleted()
    assert new_state.unsafe_buffer_pointer() == pointer
