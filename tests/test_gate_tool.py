"""The GPU gate tool's kernel-set parser (tools/gpu_golden_gate.py), which runs on the CPU: single mixers swapped
into a set to find the kernel that moves the gate (docs/accuracy.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qwen35_jax.kernels import PALLAS, REF

GATE = Path(__file__).resolve().parents[1] / "tools" / "gpu_golden_gate.py"


@pytest.fixture(scope="module")
def gate():
    spec = importlib.util.spec_from_file_location("gpu_golden_gate", GATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_plain_set_is_the_set(gate):
    base, mix = gate.kernel_set("pallas")
    assert base == "pallas" and mix == PALLAS._replace(name="pallas")


def test_swaps_replace_only_the_named_mixers(gate):
    base, mix = gate.kernel_set("pallas+gdn_prefill=ref+conv_update=ref")
    assert base == "pallas" and mix.name == "pallas+gdn_prefill=ref+conv_update=ref"
    assert mix.gdn_prefill is REF.gdn_prefill and mix.conv_update is REF.conv_update
    assert mix.prefill_attention is PALLAS.prefill_attention and mix.conv_prefill is PALLAS.conv_prefill


def test_unknown_mixers_and_sets_are_refused(gate):
    for bad in ("pallas+attention=ref", "pallas+gdn_prefill=triton", "pallas+gdn_prefill"):
        with pytest.raises(ValueError, match="a swap is KERNEL=SET"):
            gate.kernel_set(bad)
