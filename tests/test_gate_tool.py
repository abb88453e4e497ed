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


def test_bf16_gdn_prefill_and_unknown_mixers(gate):
    _, mix = gate.kernel_set("pallas+gdn_prefill=pallas-bf16")
    assert mix.gdn_prefill is not PALLAS.gdn_prefill and mix.decode_attention is PALLAS.decode_attention
    with pytest.raises(ValueError, match="a swap is KERNEL=SET"):
        gate.kernel_set("pallas+attention=ref")


def test_the_gate_runs_the_model_as_the_engine_serves_it(gate):
    """The gate compares the model in the engine's default form (fused weights, in-pool GDN states), and that
    form gives the checkpoint layout's logits on the tiny model. Tolerance 1e-3 on logits of std ~0.16: in-pool
    states and the fused MLP are bit-identical here; the fused input projections' wider CPU GEMMs differ by a few
    fp32 ulps, which this prompt's GDN recurrence carries to 2.5e-4 at token 6 (measured; 1e-6 at token 0; 2.7e-5
    for tests/test_model.py's prompt); a mis-split or mis-ordered fused weight moves logits by O(0.1)."""
    import numpy as np

    from qwen35_jax.api import load_model
    from qwen35_jax.serving.factory import EngineConfig

    model = load_model("tiny", dtype="float32")
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, 500, 40)]
    before = model.logits_incremental(tokens, decode_from=30)
    served = gate.as_the_engine_serves(model)
    defaults = EngineConfig()
    assert served == {"fused_mlp": defaults.fused_mlp, "fused_qkv": defaults.fused_qkv, "gdn_state": defaults.gdn_state}
    assert model.model_def.fused_qkv and model.model_def.fused_mlp and model.model_def.gdn_state == "in_pool"
    np.testing.assert_allclose(model.logits_incremental(tokens, decode_from=30), before, atol=1e-3, rtol=0)
