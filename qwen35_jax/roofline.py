"""The physical limits that every benchmark figure is printed beside, per GPU, as `tools/device_limits.py`
measured them on that card: HBM bandwidth as a device-to-device copy (bytes read and written), and the dense bf16
matrix rate as an 8192^3 product on random data (docs/performance.md).

A floor borrowed from another card misleads (an H100 copies at ~70% of an H200's rate, so an H100 step held to
the H200's floor reads as far from its limit), so a card not in the table has no limits unless they are given:
`QWEN35_JAX_DEVICE_LIMITS` names a JSON file that `tools/device_limits.py --json` wrote on that card.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple


class DeviceLimits(NamedTuple):
    hbm_bytes_per_s: float
    bf16_flops_per_s: float


MEASURED = {
    "NVIDIA H200": DeviceLimits(4.3e12, 790e12),
    # The device's own record (a copy at ~3.0 TB/s, the product at 798 TFLOP/s, through PyTorch), until
    # device_limits.py runs on one through this project.
    "NVIDIA H100 80GB HBM3": DeviceLimits(3.0e12, 790e12),
}

# The card that the targets and docs/performance.md's tables are stated on.
H200 = MEASURED["NVIDIA H200"]
HBM_BYTES_PER_S, BF16_FLOPS_PER_S = H200


def device_limits(device_kind: str | None = None) -> DeviceLimits | None:
    """The limits of `device_kind` (the first JAX device's kind when None): the JSON that QWEN35_JAX_DEVICE_LIMITS
    names when it is set, else the table's row, else None (a CPU, or a card nobody measured)."""
    path = os.environ.get("QWEN35_JAX_DEVICE_LIMITS")
    if path:
        with open(path) as f:
            measured = json.load(f)
        return DeviceLimits(measured["hbm_tb_per_s"] * 1e12, measured["bf16_tflop_per_s"] * 1e12)
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    return MEASURED.get(device_kind)


def require_device_limits(device_kind: str | None = None) -> DeviceLimits:
    """device_limits, for the GPU benchmarks: a card without limits is an error naming the way to give them."""
    limits = device_limits(device_kind)
    if limits is None:
        raise SystemExit(
            f"no measured limits for this device (known: {sorted(MEASURED)}); run tools/device_limits.py --json FILE "
            "on it and set QWEN35_JAX_DEVICE_LIMITS=FILE"
        )
    return limits
