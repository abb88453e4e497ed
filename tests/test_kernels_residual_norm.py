"""The residual add + RMSNorm kernel (`kernels.residual_norm`) against its reference: in interpret mode on the
CPU, lowered for the H200, and compiled on the GPU (`-m gpu`) at 4B shapes.

Tolerances. Kernel and reference run the same fp32 operations except two sums taken in other orders: the split-K
partials (S terms) and the row's squares (N terms).
- fp32 models: each sum is within ~S * 2^-24 (resp. N * 2^-24) relative of the exact one, so h' and the norm agree
  to 2^-16 relative of the row's magnitude (N = 2560: 1.5e-4 relative worst case; 1e-5 is what the stated
  bound leaves after the sqrt halves the squares' error, and is far above what is seen).
- bf16 models: a different fp32 sum can round the product's output or h' to the neighbouring bf16 value, so h'
  may sit one step (2^-8 of |out| + 2^-8 of |h'|) from the reference's, and the norm one step (2^-8 relative)
  from its value at that h'. A dropped partial, a wrong eps or weight form moves values by O(1) relative
  (the small-magnitude case makes eps count: mean(h'^2) ~ eps there).
With one partial (S = 1) the first sum is the same, so h' must be identical.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import lower_for_h200

from qwen35_jax.kernels import mixers
from qwen35_jax.kernels.linear import MAX_ROWS, linear_pallas, linear_ref
from qwen35_jax.kernels.residual_norm import add_rms_norm_pallas, add_rms_norm_ref

EPS = 1e-6


def case(rows, n, splits, dtype, scale=1.0, seed=0):
    """h ~ N(0, 1) * scale, S partials summing to ~N(0, 1) * scale, norm weight ~ N(0, 0.3) (zero-centred)."""
    kh, kp, kw = jax.random.split(jax.random.key(seed), 3)
    h = (scale * jax.random.normal(kh, (rows, n))).astype(dtype)
    partials = scale * jax.random.normal(kp, (splits, rows, n)) / np.sqrt(splits)
    weight = (0.3 * jax.random.normal(kw, (n,))).astype(dtype)
    return h, partials.astype(jnp.float32), weight


def f64(x):
    return np.float64(np.float32(x))


def assert_close_to_reference(ours, ref, h, partials):
    (h_ours, y_ours), (h_ref, y_ref) = ours, ref
    assert h_ours.shape == h_ref.shape and h_ours.dtype == h_ref.dtype == y_ours.dtype
    if h.dtype == jnp.float32:
        magnitude = np.abs(f64(h_ref)).max()
        np.testing.assert_allclose(f64(h_ours), f64(h_ref), rtol=0, atol=1e-5 * magnitude)
        np.testing.assert_allclose(f64(y_ours), f64(y_ref), rtol=0, atol=1e-5 * np.abs(f64(y_ref)).max())
        return
    out = np.abs(f64(partials).sum(axis=0))
    step = 2.0**-8 * (out + np.abs(f64(h_ref)))
    assert np.all(np.abs(f64(h_ours) - f64(h_ref)) <= step)
    assert np.all(np.abs(f64(y_ours) - f64(y_ref)) <= 2.0**-7 * np.abs(f64(y_ref)) + 1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows, n, splits", [(1, 2560, 8), (3, 2560, 1), (MAX_ROWS, 1536, 4), (5, 48, 2)])
@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_matches_reference(rows, n, splits, dtype, scale):
    """Rows 1..MAX_ROWS, 1-8 partials (powers of two: `fits_kernel`), N in 512-wide pieces (4B's 2560), 512 + 1024 (1536), or 16-wide (48);
    scale 1e-3 puts mean(h^2) at eps's size."""
    h, partials, weight = case(rows, n, splits, dtype, scale)
    ours = add_rms_norm_pallas(h, partials, weight, EPS, interpret=True)
    ref = add_rms_norm_ref(h, partials, weight, EPS)
    assert_close_to_reference(ours, ref, h, partials)
    if splits == 1:
        np.testing.assert_array_equal(f64(ours[0]), f64(ref[0]))


def test_reference_is_the_models_add_then_norm():
    """The reference rounds the product's output to the model dtype before the add, as the products did when
    they returned it (`linear`), and the norm is `rms_norm`'s."""
    h, partials, weight = case(2, 64, 3, jnp.bfloat16)
    out = partials.sum(axis=0).astype(jnp.bfloat16)
    new_h, normed = add_rms_norm_ref(h, partials, weight, EPS)
    np.testing.assert_array_equal(f64(new_h), f64(h + out))
    x32 = f64(new_h)
    expected = x32 / np.sqrt((x32 * x32).mean(-1, keepdims=True) + EPS) * (1 + f64(weight))
    np.testing.assert_allclose(f64(normed), expected, rtol=2.0**-7)


def test_what_the_kernel_does_not_take_is_the_reference_exactly():
    """No partials (the first layer), more rows than MAX_ROWS (XLA's products), a row no 16-wide piece divides,
    a number of partials that is not a power of two."""
    for rows, n, splits in [(2, 256, 0), (MAX_ROWS + 1, 256, 2), (2, 40, 2), (4, 256, 3), (4, 256, 6)]:
        h, partials, weight = case(rows, n, max(splits, 1), jnp.bfloat16)
        partials = partials if splits else None
        ours = add_rms_norm_pallas(h, partials, weight, EPS, interpret=True)
        ref = add_rms_norm_ref(h, partials, weight, EPS)
        for a, b in zip(ours, ref, strict=True):
            np.testing.assert_array_equal(f64(a), f64(b))


def test_partials_must_match_the_rows():
    h, partials, weight = case(2, 256, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"expected \[S, M, N\]"):
        add_rms_norm_pallas(h, partials[:, :1], weight, EPS, interpret=True)


@pytest.mark.parametrize("kernel", [linear_pallas, linear_ref])
@pytest.mark.parametrize("m, splits", [(1, 4), (3, 1), (MAX_ROWS + 1, None)])
def test_products_partials_add_up_to_their_output(kernel, m, splits):
    """`partials=True` hands over the fp32 sums the product would have added and rounded itself: the same
    numbers, so adding and rounding them gives its output bit for bit."""
    kx, kw = jax.random.split(jax.random.key(m))
    x = jax.random.normal(kx, (m, 1024)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (256, 1024)).astype(jnp.bfloat16)
    kwargs = {"splits": splits, "interpret": True} if kernel is linear_pallas else {}
    parts = kernel(x, w, partials=True, **kwargs)
    expected_splits = 1 if kernel is linear_ref or m > MAX_ROWS else splits
    assert parts.shape == (expected_splits, m, 256) and parts.dtype == jnp.float32
    np.testing.assert_array_equal(f64(parts.sum(axis=0).astype(jnp.bfloat16)), f64(kernel(x, w, **kwargs)))


def test_xlas_in_both_sets_the_kernel_a_named_alternative():
    """Measured slower on the H200 (module notes), the kernel is `pallas+add_norm=triton`, not the default."""
    assert mixers("ref").add_norm is add_rms_norm_ref and mixers("pallas").add_norm is add_rms_norm_ref
    swapped = mixers("pallas+add_norm=triton", interpret=True)
    assert swapped.add_norm is not add_rms_norm_ref and swapped.linear is mixers("pallas", interpret=True).linear
    h, partials, weight = case(1, 256, 8, jnp.bfloat16)
    assert_close_to_reference(swapped.add_norm(h, partials, weight, EPS), add_rms_norm_ref(h, partials, weight, EPS),
                              h, partials)  # fmt: skip


def test_the_kernel_in_the_model(tiny_model):
    """The tiny model's logits with the kernel at every norm point of the decode steps (rows <= MAX_ROWS) match the
    reference set's: 1e-4 on fp32 logits, as tests/test_kernels_in_model.py (the kernel agrees with XLA's add and
    norm to ~1e-6 relative in fp32)."""
    from test_kernels_in_model import PROMPT

    ref = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    tiny_model.kernels = mixers("ref+add_norm=triton", interpret=True)
    try:
        ours = tiny_model.logits_incremental(PROMPT, chunk_sizes=[40, 30], decode_from=80)
    finally:
        tiny_model.kernels = mixers("ref")
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_lowers_to_triton_for_h200():
    """4B's hidden size at batch 1 with 8 partials (out_proj's split) and at MAX_ROWS with one: one Triton kernel,
    a program per row."""
    spec = jax.ShapeDtypeStruct
    grids = []
    for rows, splits in [(1, 8), (MAX_ROWS, 1)]:
        args = (spec((rows, 2560), jnp.bfloat16), spec((splits, rows, 2560), jnp.float32), spec((2560,), jnp.bfloat16))
        text = lower_for_h200(lambda h, p, w: add_rms_norm_pallas(h, p, w, EPS), *args).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        grids.append(re.findall(r"grid_[xyz] = (\d+)", text))
    assert grids == [["1", "1", "1"], [str(MAX_ROWS), "1", "1"]]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, splits", [(1, 8), (16, 4), (MAX_ROWS, 1)])
def test_gpu_matches_reference_at_4b_shapes(rows, splits):
    h, partials, weight = case(rows, 2560, splits, jnp.bfloat16, seed=rows)
    ours = jax.jit(lambda h, p, w: add_rms_norm_pallas(h, p, w, EPS))(h, partials, weight)
    assert_close_to_reference(ours, add_rms_norm_ref(h, partials, weight, EPS), h, partials)
