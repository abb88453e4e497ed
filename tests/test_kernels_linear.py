"""The decode weight-product kernel (`kernels.linear`) against its reference and against exact products: in
interpret mode on the CPU, lowered for the H200, and compiled on the GPU (`-m gpu`) at 4B shapes.

Tolerances, from the summation-error bound: both sides sum K fp32 products of the same operands, in different
orders (blocks of block_k, splits added last), so each differs from the exact sum by at most
gamma_K * sum_k |x_k w_k| with gamma_K ~ K * 2^-24 (the standard worst-case bound for recursive summation;
tensor-core and blocked sums are tighter). fp32 inputs: |kernel - exact| <= K * 2^-24 * (|x| @ |w|^T).
bf16 outputs add one rounding to bf16: 2^-8 of |exact| (half an ulp each side of a rounding boundary, so
kernel and reference may sit one bf16 step apart). A dropped K split, block or wrong column moves outputs by
O(|x| @ |w|^T), orders of magnitude above these bounds.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels import check_selectable, mixers
from qwen35_jax.kernels.linear import MAX_ROWS, default_splits, linear_pallas, linear_ref


def operands(m, n, k, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, k)).astype(dtype), jax.random.normal(kw, (n, k)).astype(dtype)


def assert_within_summation_bound(y, x, w, slack=0.0):
    """y against the exact product (float64 on the host), within the bound of the module docstring (+ slack)."""
    x64, w64 = np.float64(np.float32(x)), np.float64(np.float32(w))
    exact, magnitude = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    k = x.shape[-1]
    bound = k * 2.0**-24 * magnitude + slack
    if y.dtype == jnp.bfloat16:
        bound = bound + 2.0**-8 * np.abs(exact)
    err = np.abs(np.float64(np.float32(y)) - exact)
    assert np.all(err <= bound), f"max err {err.max():.3g}, bound there {bound.flat[np.argmax(err - bound)]:.3g}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, n, k, splits", [(1, 256, 1024, None), (5, 128, 2048, 2), (16, 64, 512, 1),
                                             (MAX_ROWS, 192, 768, 3), (3, 32, 64, None)])  # fmt: skip
def test_matches_exact_product_within_summation_bound(m, n, k, splits, dtype):
    """Rows 1..MAX_ROWS (padded to tensor-core tiles inside), K split or not, N and K not powers of two."""
    x, w = operands(m, n, k, dtype)
    y = linear_pallas(x, w, splits=splits, interpret=True)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_within_summation_bound(y, x, w)
    assert_within_summation_bound(linear_ref(x, w), x, w)  # the bound holds for the reference too


def test_x_must_match_the_weights_k():
    x, w = operands(2, 64, 256, jnp.float32)
    with pytest.raises(ValueError, match="does not match w's K=256"):
        linear_pallas(x[:, :128], w, interpret=True)


def test_leading_dims_are_flattened_and_restored():
    x, w = operands(6, 128, 256, jnp.float32)
    y = linear_pallas(x.reshape(2, 3, 256), w, interpret=True)
    assert y.shape == (2, 3, 128)
    np.testing.assert_array_equal(y.reshape(6, 128), linear_pallas(x, w, interpret=True))


@pytest.mark.parametrize("m, n, k", [(MAX_ROWS + 1, 128, 256), (4, 40, 256), (4, 64, 200)])
def test_what_the_kernel_does_not_take_is_the_reference_exactly(m, n, k):
    """More rows than MAX_ROWS (prefill), or N / K not multiples of 16: XLA's product, bit for bit."""
    x, w = operands(m, n, k, jnp.bfloat16)
    np.testing.assert_array_equal(np.float32(linear_pallas(x, w, interpret=True)), np.float32(linear_ref(x, w)))


def test_explicit_tiles_must_divide():
    """A sweep's explicit tiling that does not fit is refused, never silently replaced by XLA's product."""
    x, w = operands(1, 64, 512, jnp.float32)
    with pytest.raises(ValueError, match="splits=3"):
        linear_pallas(x, w, block_k=128, splits=3, interpret=True)
    with pytest.raises(ValueError, match="block_n=48"):
        linear_pallas(x, w, block_n=48, interpret=True)
    with pytest.raises(ValueError, match="block_k=384"):
        linear_pallas(x, w, block_k=384, interpret=True)
    with pytest.raises(ValueError, match="block_n=64 does not divide 32"):  # glu_out: block_n tiles each half
        linear_pallas(x, w, block_n=64, glu_out=True, interpret=True)


def test_default_splits_reach_enough_programs_on_narrow_weights():
    """4B: N = 2560 (out_proj, down) gets its K split; wide weights (gate/up, 18432) barely; every split keeps
    >= 4 block_k steps and divides K's steps."""
    assert default_splits(2560, 9216, 64, 256) == 9  # 36 steps: 40 x 9 programs
    assert default_splits(2560, 4096, 64, 256) == 4  # 16 steps
    assert default_splits(18432, 2560, 64, 256) == 2  # 10 steps: 288 x 2
    assert default_splits(64, 512, 64, 256) == 1  # 2 steps: no split leaves 4


def test_lowers_to_triton_for_h200():
    """4B gate/up and down products at batch 1 and MAX_ROWS (32): Triton accepts the default tiles (block_n 32, block_k 128);
    the grids are (N/32, splits)."""
    spec = jax.ShapeDtypeStruct
    grids = []
    for m, n, k in [(1, 18432, 2560), (MAX_ROWS, 2560, 9216)]:
        text = lower_for_h200(linear_pallas, spec((m, k), jnp.bfloat16), spec((n, k), jnp.bfloat16)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        grids.append(re.findall(r"grid_[xyz] = (\d+)", text))
    assert grids == [["576", "1", "1"], ["80", "8", "1"]]


def test_kernel_sets_swap_single_kernels():
    """`pallas+linear=ref`: the Pallas set with XLA's products (an A/B flag of the engine); bad swaps refused."""
    swapped = mixers("pallas+linear=ref", interpret=True)
    pallas = mixers("pallas", interpret=True)
    assert swapped.linear is mixers("ref").linear and swapped.name == "pallas+linear=ref"
    assert swapped._replace(linear=pallas.linear, name=pallas.name) == pallas
    for bad in ("pallas+linear", "pallas+lin=ref", "pallas+linear=triton"):
        with pytest.raises(ValueError, match="a swap is KERNEL=SET"):
            mixers(bad)
    with pytest.raises(ValueError, match="needs a GPU"):
        check_selectable("ref+linear=pallas", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 18432, 2560), (16, 2560, 9216), (32, 2560, 4096), (32, 8192, 2560),
                                     (1, 32, 2560)])  # fmt: skip
def test_gpu_matches_exact_product_at_4b_shapes(m, n, k):
    x, w = operands(m, n, k, jnp.bfloat16, seed=m)
    y = jax.jit(linear_pallas)(x, w)
    assert_within_summation_bound(y, x, w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m, half, k", [(1, 256, 1024), (5, 64, 512), (MAX_ROWS, 48, 768), (MAX_ROWS + 1, 64, 256)])
@pytest.mark.parametrize("epilogue", [True, False])
def test_glu_out_is_the_activation_of_the_reference_halves(m, half, k, dtype, epilogue, monkeypatch):
    """glu_out: silu_mul of the gate and up halves' products, each rounded to the model dtype first. The kernel's
    halves are within the summation bound of the exact products (as the plain kernel); so the activation is
    checked against silu_mul of the exact halves rounded the same way, within one more rounding step of each
    half (2^-8 relative for bf16: gate and up may each round to the neighbouring value; silu is 1.1-Lipschitz)
    plus the output's own rounding. Rows above MAX_ROWS take the reference exactly. Both forms (GLU_EPILOGUE)."""
    from qwen35_jax.kernels import linear

    monkeypatch.setattr(linear, "GLU_EPILOGUE", epilogue)
    x, w = operands(m, 2 * half, k, dtype, seed=m)
    y = linear_pallas(x, w, glu_out=True, interpret=True)
    assert y.shape == (m, half) and y.dtype == dtype
    x64, w64 = np.float64(np.float32(x)), np.float64(np.float32(w))
    exact, magnitude = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    gate, up = np.split(exact, 2, axis=-1)
    gate_mag, up_mag = np.split(magnitude, 2, axis=-1)
    act = gate / (1 + np.exp(-gate)) * up
    unit = 2.0**-8 if dtype == jnp.bfloat16 else k * 2.0**-24
    bound = 1.1 * unit * gate_mag * np.abs(up) + unit * up_mag * np.abs(gate) * 1.1 + 2 * unit * np.abs(act) + 1e-6
    err = np.abs(np.float64(np.float32(y)) - act)
    assert np.all(err <= bound), f"max err {err.max():.3g}"
    if m > MAX_ROWS:
        np.testing.assert_array_equal(np.float32(y), np.float32(linear_ref(x, w, glu_out=True)))
    else:  # a mutation that mixes the halves or drops K steps is O(1) off; this pins the kernel's grid too
        np.testing.assert_allclose(np.float32(y), np.float32(linear_ref(x, w, glu_out=True)), rtol=0,
                                   atol=float(np.max(bound)))  # fmt: skip


def test_glu_out_lowers_to_one_kernel_for_h200(monkeypatch):
    """GLU_EPILOGUE on, 4B's fused gate/up at batch 1: one Triton kernel, a program per GLU_OUT_BLOCK_N (32)
    activation columns (9216 / 32)."""
    from qwen35_jax.kernels import linear

    monkeypatch.setattr(linear, "GLU_EPILOGUE", True)
    spec = jax.ShapeDtypeStruct
    text = lower_for_h200(lambda x, w: linear_pallas(x, w, glu_out=True), spec((1, 2560), jnp.bfloat16),
                          spec((18432, 2560), jnp.bfloat16)).as_text()  # fmt: skip
    assert text.count("__gpu$xla.gpu.triton") == 1 and "linear_glu_out" in text
    assert re.findall(r"grid_[xyz] = (\d+)", text) == ["288", "1", "1"]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, MAX_ROWS])
def test_gpu_glu_out_at_4b_shapes(m, monkeypatch):
    """The epilogue form (GLU_EPILOGUE, off by default) compiled for the GPU, against the reference."""
    from qwen35_jax.kernels import linear

    monkeypatch.setattr(linear, "GLU_EPILOGUE", True)
    x, w = operands(m, 18432, 2560, jnp.bfloat16, seed=m)
    y = jax.jit(functools.partial(linear_pallas, glu_out=True))(x, w)
    ref = linear_ref(x, w, glu_out=True)
    scale = float(np.max(np.abs(np.float32(ref))))
    np.testing.assert_allclose(np.float32(y), np.float32(ref), rtol=2.0**-6, atol=2.0**-7 * scale)


def test_glu_out_without_the_epilogue_is_the_plain_product_then_xlas_activation(monkeypatch):
    """GLU_EPILOGUE off: the fused weight's plain kernel product, split, then silu_mul in XLA (the form before the
    epilogue): bit for bit those steps."""
    from qwen35_jax.kernels import linear

    monkeypatch.setattr(linear, "GLU_EPILOGUE", False)
    x, w = operands(3, 128, 512, jnp.bfloat16, seed=3)
    y = linear_pallas(x, w, glu_out=True, interpret=True)
    gate, up = jnp.split(linear_pallas(x, w, interpret=True), 2, axis=-1)
    np.testing.assert_array_equal(np.float32(y), np.float32(linear.silu_mul(gate, up)))
    text = lower_for_h200(lambda x, w: linear_pallas(x, w, glu_out=True), jax.ShapeDtypeStruct((1, 2560), jnp.bfloat16),
                          jax.ShapeDtypeStruct((18432, 2560), jnp.bfloat16)).as_text()  # fmt: skip
    assert "linear_glu_out" not in text and re.findall(r"grid_[xyz] = (\d+)", text) == ["576", "1", "1"]
