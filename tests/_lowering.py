"""Lowering for an abstract H200, shared by the kernel tests: the Pallas Triton lowering runs on the CPU with no
GPU present, so a CPU test can check what Triton accepts, the grids, the aliases and the emitted Triton IR."""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, *args) -> jax.stages.Lowered:
    """`fn` traced with `args` (arrays or ShapeDtypeStructs) and lowered for the abstract H200."""
    return lower_jitted_for_h200(jax.jit(fn), *args)


def lower_jitted_for_h200(jitted, *args) -> jax.stages.Lowered:
    """The same for a function already wrapped in jax.jit (its donation and static arguments kept)."""
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",))
