"""Facts of the device the kernels are built for, read from JAX's first device."""

from __future__ import annotations

import functools

import jax

# Interpret mode on a machine without a GPU builds the grids the H200 (132 SMs) gets, so the CPU tests cover them.
FALLBACK_SM_COUNT = 132


@functools.cache
def sm_count() -> int:
    """The streaming multiprocessors of JAX's first device (FALLBACK_SM_COUNT where it has none: the CPU)."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", 0) if device.platform == "gpu" else 0
    return count or FALLBACK_SM_COUNT
