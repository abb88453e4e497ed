"""The host packs a step's inputs into one int32 array (`InputLayout`); the program takes them apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.batch import DecodeSide, InputLayout, PrefillSide, StepInputs


def numbered_inputs(b: int, p: int, t: int, w: int) -> StepInputs:
    """Every element of every field distinct, so a slice at the wrong offset or of the wrong shape shows."""
    counter = iter(range(1_000_000))

    def arange(*shape):
        return np.array([next(counter) for _ in range(int(np.prod(shape)))], np.int32).reshape(shape)

    decode = DecodeSide(None, arange(b), arange(b), arange(b, w)) if b else None
    prefill = PrefillSide(arange(p, t), arange(p), arange(p), arange(p), arange(p, w)) if p else None
    return StepInputs(decode, prefill)


@pytest.mark.parametrize("key", [(4, 0, 0), (0, 2, 16), (2, 1, 64)])
def test_unpacking_the_packed_inputs_gives_each_field_back(key):
    inputs = numbered_inputs(*key, w=5)
    layout = InputLayout.of(inputs)
    packed = layout.pack(inputs)
    assert packed.shape == (layout.size,) and packed.dtype == np.int32
    unpacked = jax.jit(layout.unpack)(jnp.asarray(packed))
    assert jax.tree.structure(unpacked) == jax.tree.structure(inputs)
    for got, want in zip(jax.tree.leaves(unpacked), jax.tree.leaves(inputs), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_inputs_of_another_layout_are_refused():
    layout = InputLayout.of(numbered_inputs(2, 1, 16, w=5))
    with pytest.raises(ValueError, match="do not fit"):
        layout.pack(numbered_inputs(2, 1, 32, w=5))  # another chunk bucket
    with pytest.raises(ValueError, match="do not fit"):
        layout.pack(numbered_inputs(2, 0, 0, w=5))  # no prefill side


def test_layouts_of_the_same_shapes_are_equal_and_hash_alike():
    """The jitted step takes the layout as a static argument: equal layouts must share one trace."""
    a, b = InputLayout.of(numbered_inputs(2, 1, 16, w=5)), InputLayout.of(numbered_inputs(2, 1, 16, w=5))
    assert a == b and hash(a) == hash(b)
    assert a != InputLayout.of(numbered_inputs(2, 1, 16, w=6))
