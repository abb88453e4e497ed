"""The bf16 golden gate at Qwen3.5-4B shapes on the GPU (docs/accuracy.md): HF transformers builds and runs a
seeded random model, this project loads the saved safetensors folder. Needs torch + transformers 5.17."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GATE = Path(__file__).resolve().parents[1] / "tools" / "gpu_golden_gate.py"


def _gate_module():
    spec = importlib.util.spec_from_file_location("gpu_golden_gate", GATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gate_reports(tmp_path_factory):
    """HF runs once; both kernel sets are compared with the same HF numbers."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    workdir = Path(os.environ.get("QWEN35_GATE_WORKDIR", tmp_path_factory.mktemp("gate")))
    gate = _gate_module()
    return gate, gate.run_gates(workdir, seed=0, kernel_sets=("ref", "pallas"))


@pytest.mark.parametrize("kernels", ["ref", "pallas"])
def test_bf16_gate_at_4b_shapes(gate_reports, kernels):
    gate, reports = gate_reports
    report = reports[kernels]
    out = os.environ.get("OUT")
    if out:
        Path(out, f"gate_{kernels}.json").write_text(json.dumps(report, indent=2))
    failed = [line for line in gate.enforced(report) if not line["pass"]]
    assert not failed, json.dumps(failed, indent=2)
