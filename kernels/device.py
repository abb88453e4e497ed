"""Facts of the device the kernels are built for, read from JAX's first device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

# Interpret mode on a machine without a GPU builds the grids the H200 (132 SMs) gets, so the CPU tests cover them.
FALLBACK_SM_COUNT = 132


@functools.cache
def sm_count() -> int:
    """The streaming multiprocessors of JAX's first device (FALLBACK_SM_COUNT where it has none: the CPU)."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", 0) if device.platform == "gpu" else 0
    return count or FALLBACK_SM_COUNT


def start_dependents(index, enabled: bool = True):
    """index (an int32 scalar: a program id), handed back once this program has let the stream's next kernel
    launch (PTX `griddepcontrol.launch_dependents`).

    Why: from Hopper on XLA launches a step's kernels with programmatic dependent launch and puts
    `griddepcontrol.wait` (the previous grid finished, its writes visible) at the entry of each, but only its own
    GEMMs signal: after a Pallas kernel the next one is launched when this one's last program exits, and a batch-1
    step is ~250 kernels of a few microseconds each. Signalling at entry lets the next kernel's programs be placed
    and reach their wait while this one runs; the wait keeps the order, so what the kernels compute is unchanged.
    The index goes through the instruction so that the compiler keeps it and places it before the index's uses.
    Measured: 27 us (0.8%) off a 4B batch-1 step on the H100, nothing at batch 64 (docs/performance.md).
    enabled False (interpret mode runs no PTX) hands the index back as it is."""
    if not enabled:
        return index
    (out,) = pltriton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;",
        args=[jnp.full((1,), index, jnp.int32)],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)],
    )
    return jnp.sum(out)
