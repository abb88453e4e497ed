"""Checkpoint loading: layouts, coverage and shape errors that name the tensor, configs, orbax conversion."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qwen35_jax.api import load_model
from qwen35_jax.cli import main as cli_main
from qwen35_jax.config import UnsupportedModelError, config_from_hf, preset
from qwen35_jax.weights import CheckpointError, weight_specs

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
TEXT_CASE = GOLDEN / "tied_gqa2_ratio2"  # single file, keys under model.
COMPOSITE_CASE = GOLDEN / "composite_untied_gqa2"  # model.language_model., vision tower, mtp.*
SHARDED_CASE = GOLDEN / "untied_gqa4_ratio1_sharded"
PROMPT = [3, 17, 99, 4, 150, 8, 42, 77, 1, 5]


def _copy(case: Path, tmp_path: Path) -> Path:
    dst = tmp_path / case.name
    shutil.copytree(case, dst)
    return dst


def _rewrite_single_file(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path):
    folder = _copy(TEXT_CASE, tmp_path)
    _rewrite_single_file(folder, lambda t: t.pop("model.layers.5.linear_attn.in_proj_z.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*layers\.5\.linear_attn\.in_proj_z\.weight"):
        load_model(folder, dtype="float32")


def test_wrong_shape_is_named(tmp_path):
    folder = _copy(TEXT_CASE, tmp_path)
    key = "model.layers.3.self_attn.k_proj.weight"

    def edit(tensors):
        tensors[key] = tensors[key][:-1]

    _rewrite_single_file(folder, edit)
    with pytest.raises(CheckpointError, match=r"layers\.3\.self_attn\.k_proj\.weight has shape"):
        load_model(folder, dtype="float32")


def test_unexpected_tensor_is_named(tmp_path):
    folder = _copy(TEXT_CASE, tmp_path)
    _rewrite_single_file(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(2, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.0\.mlp\.extra\.weight"):
        load_model(folder, dtype="float32")


def test_unknown_model_type_is_named(tmp_path):
    folder = _copy(TEXT_CASE, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'llama'"):
        load_model(folder, dtype="float32")


def test_moe_is_refused_as_unsupported():
    with pytest.raises(UnsupportedModelError, match="Mixture-of-Experts"):
        config_from_hf({"model_type": "qwen3_5_moe"})


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)


def test_composite_config_reads_text_config():
    config = json.loads((COMPOSITE_CASE / "config.json").read_text())
    cfg = config_from_hf(config)
    assert config["model_type"] == "qwen3_5" and cfg.hidden_size == config["text_config"]["hidden_size"]
    assert cfg.tie_word_embeddings is False


def test_composite_skips_mtp_and_vision_on_purpose(caplog):
    with caplog.at_level(logging.INFO, logger="qwen35_jax.weights"):
        load_model(COMPOSITE_CASE, dtype="float32")
    assert any("skipping" in r.message and "mtp" in r.message and "visual" in r.message for r in caplog.records)


def test_table_declares_every_layer_once():
    cfg = preset("4b")
    keys = [k for spec in weight_specs(cfg, np.float32) for k in spec.hf_keys]
    assert len(keys) == len(set(keys))
    # 4B: 24 GDN layers x 14 tensors + 8 attention layers x 11 + embedding + final norm (tied head).
    assert len(keys) == 24 * 14 + 8 * 11 + 2


def test_published_shapes_count_parameters():
    specs = weight_specs(preset("4b"), np.float32)
    total = sum(int(np.prod(part.shape)) * len(part.hf_keys) for s in specs for part in s.parts)
    assert total == pytest.approx(4.206e9, rel=1e-3)  # the published 4.206 B parameters


def test_sharded_and_single_file_layouts_load():
    for case in (SHARDED_CASE, TEXT_CASE):
        logits = load_model(case, dtype="float32").logits(PROMPT)
        assert logits.shape[0] == len(PROMPT) and np.isfinite(logits).all()


def test_convert_to_orbax_round_trips(tmp_path):
    dst = tmp_path / "converted"
    assert cli_main(["convert", str(SHARDED_CASE), str(dst), "--dtype", "float32"]) == 0
    original = load_model(SHARDED_CASE, dtype="float32").logits(PROMPT)
    converted = load_model(dst, dtype="float32").logits(PROMPT)
    np.testing.assert_array_equal(converted, original)  # the same weights: bit-identical logits


def test_fused_weights_are_the_checkpoint_tensors_rows_in_order():
    """The GDN in_proj is [qkv | z | b | a], attention's qkv_proj [q | k | v], the MLP's gate_up_proj [gate | up],
    each part exactly the checkpoint's tensor (fp32: no rounding on the way)."""
    tensors = load_file(TEXT_CASE / "model.safetensors")
    model = load_model(TEXT_CASE, dtype="float32")
    cfg, layers = model.config, model.params["groups"]["layers"]
    attention = cfg.group_size - 1
    for position, module, fused, parts in (
        (0, "linear_attn", "in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
        (attention, "self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
        (0, "mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ):
        weight = np.asarray(layers[position][module][fused]["weight"][...])[1]  # group 1: layer group_size + position
        expected = [tensors[f"model.layers.{cfg.group_size + position}.{module}.{part}.weight"] for part in parts]
        np.testing.assert_array_equal(weight, np.concatenate(expected))


def test_orbax_folder_of_an_older_layout_asks_for_a_new_conversion(tmp_path):
    dst = tmp_path / "converted"
    assert cli_main(["convert", str(TEXT_CASE), str(dst), "--dtype", "float32"]) == 0
    (dst / "qwen35_jax_orbax.json").write_text(json.dumps({"dtype": "float32", "format": 1}))
    with pytest.raises(CheckpointError, match="convert the HF folder again"):
        load_model(dst, dtype="float32")
