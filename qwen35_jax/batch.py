"""The device-side inputs of one step: decode rows and prefill rows, already padded to their buckets.

A step is *unified*: it may carry decode rows (one token each) and prefill rows (a chunk each) together.
The dense layers run once over all their tokens; each token mixer runs per side (docs/architecture.md).
Either side may be absent (None), which gives the decode-only and prefill-only programs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeSide:
    # [B] int32: the token fed for each row. None in the engine's step inputs: the step program reads each row's
    # token from the device's token state, so the host sends none.
    tokens: jax.Array | None
    positions: jax.Array  # [B] int32: its index in the sequence (= tokens already cached)
    slots: jax.Array  # [B] int32: GDN state slot (padding rows: the trash slot)
    page_table: jax.Array  # [B, W] int32: KV pages in order (unused entries and padding rows: page 0)

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillSide:
    tokens: jax.Array  # [P, T] int32: a chunk of prompt per row, padded to the chunk bucket T
    start: jax.Array  # [P] int32: tokens of the row already cached before this chunk
    lengths: jax.Array  # [P] int32: valid tokens in the chunk (0 for padding rows)
    slots: jax.Array  # [P] int32
    page_table: jax.Array  # [P, W] int32

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def chunk(self) -> int:
        return self.tokens.shape[1]

    @property
    def positions(self) -> jax.Array:  # [P, T]
        return self.start[:, None] + jnp.arange(self.chunk, dtype=jnp.int32)[None, :]

    @property
    def valid(self) -> jax.Array:  # [P, T] bool
        return jnp.arange(self.chunk)[None, :] < self.lengths[:, None]

    @property
    def fresh(self) -> jax.Array:  # [P] bool: the row starts a new sequence
        return self.start == 0

    @property
    def last_index(self) -> jax.Array:  # [P]: index of each row's last valid token
        return jnp.maximum(self.lengths - 1, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    decode: DecodeSide | None
    prefill: PrefillSide | None

    @property
    def num_decode(self) -> int:
        return 0 if self.decode is None else self.decode.num_rows

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.prefill is None else self.prefill.num_rows * self.prefill.chunk


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """Where each array of a step's inputs sits in the one flat int32 array that the host sends for the step.

    A step program's call pays for every host array it is handed: a numpy input cost ~60 us of host time a call
    against ~10 us for a device array (H100, `tools/probe_dispatch.py`: four small numpy inputs 273 us a call,
    the same as device arrays 43 us; packed into one numpy array 116 us on another). A decode step has three inputs
    and a unified one eight, so the runner packs them into one array, and the program takes them apart with static
    slices (`unpack`). Every input is int32, so the packing is exact. Hashable: a jitted step takes it as a static
    argument."""

    treedef: jax.tree_util.PyTreeDef  # StepInputs' structure (which sides and fields are present)
    shapes: tuple[tuple[int, ...], ...]  # each leaf's shape, in the treedef's leaf order

    @classmethod
    def of(cls, inputs: StepInputs) -> InputLayout:
        """The layout of `inputs` (arrays or ShapeDtypeStructs, every leaf int32)."""
        leaves, treedef = jax.tree.flatten(inputs)
        assert all(leaf.dtype == jnp.int32 for leaf in leaves), [leaf.dtype for leaf in leaves]
        return cls(treedef, tuple(tuple(leaf.shape) for leaf in leaves))

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)

    def pack(self, inputs: StepInputs) -> np.ndarray:
        """The host's [size] int32 array of numpy `inputs`, which must have this layout."""
        leaves, treedef = jax.tree.flatten(inputs)
        if treedef != self.treedef or any(np.shape(x) != s for x, s in zip(leaves, self.shapes, strict=True)):
            raise ValueError(f"inputs {treedef} of shapes {[np.shape(x) for x in leaves]} do not fit {self}")
        return np.concatenate([np.asarray(x, np.int32).ravel() for x in leaves])

    def unpack(self, packed: jax.Array) -> StepInputs:
        """Inside the program: the StepInputs that `pack` flattened into `packed`. The barrier makes XLA
        materialise each field once: kernels that take a field as an operand need it in a buffer of its own, and
        without the barrier XLA copied the slice out again for each such kernel (14 copies in a 4B decode step,
        where the barrier leaves one a field)."""
        leaves, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            leaves.append(packed[offset : offset + size].reshape(shape))
            offset += size
        return jax.tree.unflatten(self.treedef, list(lax.optimization_barrier(leaves)))
