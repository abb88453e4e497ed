"""Weights: the tensor table, HF safetensors loading with coverage and shape checks, orbax conversion,
and seeded random weights at any preset's shapes.

The table is read off the Flax modules themselves: a parameter's module path *is* its HF key (with the
layer index rebuilt from group and position), so each tensor is declared exactly once (model.py). A fused
projection's weight is the concatenation of its checkpoint tensors' rows (`model.fused_parts`): the table lists
them, and loading, checks and random init read each part under its own HF key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import abstract_model, fused_parts

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("mtp.", "model.visual.")  # multi-token prediction head and vision tower: not for text
TEXT_PREFIXES = ("model.language_model.", "model.")
ORBAX_MARKER = "qwen35_jax_orbax.json"
ORBAX_FORMAT = 2  # the params tree with fused projections (format 1 held the checkpoint's separate tensors)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the tensor at fault."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor (or one per layer group)."""

    hf_keys: tuple[str, ...]  # one key, or one per layer group (stacked on axis 0)
    shape: tuple[int, ...]  # shape of one tensor as stored in the checkpoint


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    path: tuple  # the parameter's path in the params tree ("top"|"groups", ...)
    parts: tuple[TensorSpec, ...]  # checkpoint tensors whose rows it concatenates, in order (one: not fused)
    dtype: np.dtype

    @property
    def stacked(self) -> bool:
        return self.path[0] == "groups"

    @property
    def hf_keys(self) -> tuple[str, ...]:
        return tuple(key for part in self.parts for key in part.hf_keys)


def _names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", None)) for k in path if getattr(k, "name", "") != "value")


def _hf_keys(cfg: Qwen35Config, names: tuple) -> tuple[str, ...]:
    if names[0] == "top":
        return (".".join(str(n) for n in names[1:]),)
    _, _, position, *rest = names  # ("groups", "layers", j, ...)
    tail = ".".join(str(n) for n in rest)
    return tuple(f"layers.{g * cfg.group_size + position}.{tail}" for g in range(cfg.num_groups))


def _parts(cfg: Qwen35Config, names: tuple, shape: tuple[int, ...]) -> tuple[TensorSpec, ...]:
    """The checkpoint tensors of the parameter at `names` with (per-layer) shape `shape`."""
    fused = fused_parts(cfg).get(names[-2])
    if fused is None:
        return (TensorSpec(_hf_keys(cfg, names), shape),)
    return tuple(TensorSpec(_hf_keys(cfg, (*names[:-2], part, names[-1])), (rows, *shape[1:])) for part, rows in fused)


def weight_specs(cfg: Qwen35Config, dtype) -> list[WeightSpec]:
    _, abstract = abstract_model(cfg, dtype)
    specs = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        names = _names(path)
        shape = tuple(leaf.shape[1:]) if names[0] == "groups" else tuple(leaf.shape)
        specs.append(WeightSpec(names, _parts(cfg, names, shape), np.dtype(leaf.dtype)))
    return specs


def build_params(cfg: Qwen35Config, dtype, tensor_for: callable) -> dict:
    """Params tree on the device (group params stacked), each leaf from tensor_for(spec, part) -> array (numpy or
    on the device) of the part's stacked shape; a fused leaf concatenates its parts' rows on the device."""
    _, abstract = abstract_model(cfg, dtype)
    by_path = {spec.path: spec for spec in weight_specs(cfg, dtype)}

    def fill(path, leaf):
        spec = by_path[_names(path)]
        parts = [jnp.asarray(tensor_for(spec, part), dtype=leaf.dtype) for part in spec.parts]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)

    return jax.tree_util.tree_map_with_path(fill, abstract)


# ---- safetensors ----------------------------------------------------------------------------------------


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder}: shard files named in the index are missing: {missing}")
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


def _text_prefix(keys: list[str]) -> str:
    """The first of TEXT_PREFIXES any key has (composite checkpoints nest the text model deeper), else the last."""
    return next((prefix for prefix in TEXT_PREFIXES if any(k.startswith(prefix) for k in keys)), TEXT_PREFIXES[-1])


class SafetensorsReader:
    """Key -> (file, key in file, shape) over all shards, read from the headers once, with the text prefix
    stripped and the keys skipped on purpose set aside."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files = _shard_files(folder)
        raw = {}  # key -> (file, shape)
        for file in self.files:
            with safe_open(file, framework="numpy") as f:
                for key in f.keys():
                    raw[key] = (file, tuple(f.get_slice(key).get_shape()))
        prefix = _text_prefix(list(raw))
        self.skipped = sorted(k for k in raw if k.startswith(SKIPPED_PREFIXES))
        self.entries = {}
        for key, (file, shape) in raw.items():
            if not key.startswith(SKIPPED_PREFIXES):
                name = key[len(prefix) :] if key.startswith(prefix) else key
                self.entries[name] = (file, key, shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name: str) -> np.ndarray:
        file, key, _ = self.entries[name]
        with safe_open(file, framework="numpy") as f:
            return f.get_tensor(key)


def check_coverage(reader: SafetensorsReader, specs: list[WeightSpec]) -> None:
    expected = {key: part.shape for spec in specs for part in spec.parts for key in part.hf_keys}
    missing = sorted(set(expected) - set(reader.entries))
    if missing:
        raise CheckpointError(f"{reader.folder}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(set(reader.entries) - set(expected))
    if unexpected:
        raise CheckpointError(f"{reader.folder}: unexpected tensor(s) {unexpected[:8]} (not part of the model)")
    for key, shape in expected.items():
        found = reader.shape(key)
        if found != shape:
            raise CheckpointError(f"{reader.folder}: tensor {key} has shape {list(found)}, expected {list(shape)}")


def _as_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if array.dtype == dtype:
        return array
    return array.astype(np.float32).astype(dtype) if array.dtype == ml_dtypes.bfloat16 else array.astype(dtype)


def load_safetensors(folder: str | Path, cfg: Qwen35Config, dtype) -> dict:
    folder = Path(folder)
    reader = SafetensorsReader(folder)
    specs = weight_specs(cfg, dtype)
    check_coverage(reader, specs)
    if reader.skipped:
        kinds = sorted({k.split(".")[0] if k.startswith("mtp.") else "model.visual" for k in reader.skipped})
        log.info("skipping %d tensors on purpose (%s): not used for text serving", len(reader.skipped), kinds)

    def tensor_for(spec: WeightSpec, part: TensorSpec) -> np.ndarray:
        arrays = [_as_dtype(reader.read(key), spec.dtype) for key in part.hf_keys]
        return np.stack(arrays) if spec.stacked else arrays[0]

    return build_params(cfg, dtype, tensor_for)


# ---- orbax ----------------------------------------------------------------------------------------------


def _to_pure(params) -> dict:
    return nnx.to_pure_dict(params["top"]), nnx.to_pure_dict(params["groups"])


def save_orbax(params, cfg_json: dict, dst: str | Path, dtype_name: str) -> None:
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    top, groups = _to_pure(params)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(dst / "params", {"top": top, "groups": groups}, force=True)
    (dst / "config.json").write_text(json.dumps(cfg_json, indent=2))
    (dst / ORBAX_MARKER).write_text(json.dumps({"dtype": dtype_name, "format": ORBAX_FORMAT}))


def is_orbax_folder(folder: Path) -> bool:
    return (folder / ORBAX_MARKER).is_file()


def load_orbax(folder: str | Path, cfg: Qwen35Config, dtype) -> dict:
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    found = json.loads((folder / ORBAX_MARKER).read_text()).get("format")
    if found != ORBAX_FORMAT:
        raise CheckpointError(f"{folder}: orbax layout format {found}, this version reads {ORBAX_FORMAT}: convert the "
                              "HF folder again (qwen35-jax convert SRC DST)")  # fmt: skip
    _, abstract = abstract_model(cfg, dtype)
    target = {"top": nnx.to_pure_dict(abstract["top"]), "groups": nnx.to_pure_dict(abstract["groups"])}
    with ocp.StandardCheckpointer() as ckpt:
        try:
            restored = ckpt.restore(folder / "params", target)
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{folder}: orbax checkpoint does not match the model: {err}") from err
    for part in ("top", "groups"):
        nnx.replace_by_pure_dict(abstract[part], restored[part])
    return abstract


# ---- random weights -------------------------------------------------------------------------------------

_ZERO_CENTRED_NORM = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|^norm)\.weight$")


def _random_tensor(key: jax.Array, name: str, shape, dtype, scale: float) -> jax.Array:
    """Values in the ranges trained Qwen3.5 weights have, so activations stay finite at any depth.
    Drawn on the default device: 4B parameters take seconds there, minutes in numpy."""
    f32 = jnp.float32
    if _ZERO_CENTRED_NORM.search(name):
        value = 0.1 * jax.random.normal(key, shape, f32)
    elif name.endswith("linear_attn.norm.weight"):
        value = jax.random.uniform(key, shape, f32, 0.5, 1.5)
    elif name.endswith("A_log"):
        value = jnp.log(jax.random.uniform(key, shape, f32, 1.0, 16.0))
    elif name.endswith("dt_bias"):
        value = jax.random.normal(key, shape, f32)
    else:
        fan_in = shape[-1] if len(shape) > 1 else 1
        std = 0.02 if name.endswith("embed_tokens.weight") else scale / np.sqrt(fan_in)
        value = std * jax.random.normal(key, shape, f32)
    return value.astype(dtype)


def random_params(cfg: Qwen35Config, dtype, seed: int = 0, scale: float = 1.0) -> dict:
    """Seeded random weights at cfg's shapes (for tests and random-weight benchmarks): each checkpoint tensor is
    drawn from its own HF key, so a fused weight holds the values its parts would."""
    start = time.perf_counter()
    root = jax.random.key(seed)

    def draw(spec: WeightSpec, part: TensorSpec) -> jax.Array:
        keys = [jax.random.fold_in(root, zlib_crc(k)) for k in part.hf_keys]
        arrays = [
            _random_tensor(k, name, part.shape, spec.dtype, scale) for k, name in zip(keys, part.hf_keys, strict=True)
        ]
        return jnp.stack(arrays) if spec.stacked else arrays[0]

    params = build_params(cfg, dtype, draw)
    jax.block_until_ready(params)
    log.info("random weights for %s in %.1fs", cfg.name, time.perf_counter() - start)
    return params


def zlib_crc(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())
