"""The floors' limits follow the card the figures came from: the measured table, a device_limits.py JSON given
through QWEN35_JAX_DEVICE_LIMITS, and no floor at all for a device nobody measured (a CPU)."""

import json

import pytest

from qwen35_jax.roofline import MEASURED, device_limits, require_device_limits


def test_known_card_takes_its_measured_row(monkeypatch):
    monkeypatch.delenv("QWEN35_JAX_DEVICE_LIMITS", raising=False)
    assert device_limits("NVIDIA H200").hbm_bytes_per_s == 4.3e12
    assert device_limits("NVIDIA H100 80GB HBM3") == MEASURED["NVIDIA H100 80GB HBM3"]
    assert device_limits("NVIDIA H100 80GB HBM3") != device_limits("NVIDIA H200")


def test_unmeasured_device_has_no_limits(monkeypatch):
    monkeypatch.delenv("QWEN35_JAX_DEVICE_LIMITS", raising=False)
    assert device_limits("cpu") is None
    with pytest.raises(SystemExit, match="QWEN35_JAX_DEVICE_LIMITS"):
        require_device_limits("cpu")


def test_measured_json_overrides_the_table(tmp_path, monkeypatch):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "hbm_tb_per_s": 4.1, "bf16_tflop_per_s": 760.0}))
    monkeypatch.setenv("QWEN35_JAX_DEVICE_LIMITS", str(path))
    limits = device_limits("NVIDIA H200")
    assert limits.hbm_bytes_per_s == pytest.approx(4.1e12)
    assert limits.bf16_flops_per_s == pytest.approx(760e12)
    assert device_limits("cpu") == limits
