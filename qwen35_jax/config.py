"""The one model config: a frozen dataclass built from HF `config.json`, plus presets for tests and benchmarks.

Every number is read from `config.json` when a checkpoint is loaded; the presets exist only so that tests
and random-weight benchmarks can build a model at the published shapes without a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model or feature this engine does not implement."""


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = True
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 262144
    eos_token_ids: tuple[int, ...] = (248046, 248044)
    name: str = "custom"

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        self.validate()

    # ---- derived facts -------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def group_size(self) -> int:
        """Layers per repeated group (3 GDN + 1 attention on every published model)."""
        return self.layer_types.index(FULL) + 1

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // self.group_size

    @property
    def linear_per_group(self) -> int:
        return self.group_size - 1

    @property
    def num_linear_layers(self) -> int:
        return self.num_groups * self.linear_per_group

    @property
    def num_full_layers(self) -> int:
        return self.num_groups

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def gdn_head_ratio(self) -> int:
        """Value heads served by one GDN key head (value head j reads key head j // ratio)."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise UnsupportedModelError(f"unsupported layer types {unknown}; supported: {LINEAR}, {FULL}")
        if FULL not in self.layer_types:
            raise UnsupportedModelError("a model without full-attention layers is not supported")
        period = self.layer_types.index(FULL) + 1
        pattern = (LINEAR,) * (period - 1) + (FULL,)
        if self.num_hidden_layers % period or self.layer_types != pattern * (self.num_hidden_layers // period):
            raise UnsupportedModelError(
                "layer_types must repeat one group of linear layers followed by one full-attention layer "
                f"(the layers run as a scan over groups); got {list(self.layer_types)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2:
            raise UnsupportedModelError(f"rotary dim {self.rotary_dim} must be even")

    def to_hf_text_config(self) -> dict[str, Any]:
        """The `qwen3_5_text` config.json that HF transformers reads for this config."""
        return {
            "model_type": "qwen3_5_text",
            "architectures": ["Qwen3_5ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": mrope_section(self.rotary_dim),
                "mrope_interleaved": True,
            },
            "dtype": "bfloat16",
        }


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def mrope_section(rotary_dim: int) -> list[int]:
    """A 3-way MRoPE split summing to rotary_dim / 2 (text-only input makes it plain 1-D RoPE)."""
    half = rotary_dim // 2
    t = half - 2 * (half // 3)
    return [t, half // 3, half // 3]


def _text_section(raw: dict[str, Any]) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = " (Mixture-of-Experts Qwen3.5 is not supported yet)" if "moe" in str(model_type) else ""
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}{hint}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text = raw.get("text_config", raw) if model_type == "qwen3_5" else raw
    if text.get("num_experts") or text.get("num_local_experts"):
        raise UnsupportedModelError("Mixture-of-Experts layers are not supported yet")
    if text.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true is not supported (no published Qwen3.5 uses it)")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only silu")
    return text


def _rope(text: dict[str, Any]) -> tuple[float, float]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; only 'default'")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def config_from_hf(raw: dict[str, Any], name: str = "checkpoint") -> Qwen35Config:
    """Map an HF `config.json` dict (composite `qwen3_5` or `qwen3_5_text`) onto Qwen35Config."""
    text = _text_section(raw)
    theta, factor = _rope(text)
    eos = text.get("eos_token_id", raw.get("eos_token_id", 248044))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if 248046 not in eos_ids and text.get("vocab_size", 0) > 248046:
        eos_ids = (248046, *eos_ids)  # <|im_end|> ends chat turns; configs only name <|endoftext|>
    num_layers = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", 4)
    layer_types = tuple(text.get("layer_types") or default_layer_types(num_layers, interval))
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    hidden = text["hidden_size"]
    return Qwen35Config(
        vocab_size=text["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim", hidden // text["num_attention_heads"]),
        intermediate_size=text["intermediate_size"],
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        partial_rotary_factor=factor,
        tie_word_embeddings=bool(tie),
        layer_types=layer_types,
        max_position_embeddings=text.get("max_position_embeddings", 262144),
        eos_token_ids=eos_ids,
        name=name,
    )


def load_config(folder: str | Path) -> Qwen35Config:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return config_from_hf(json.loads(path.read_text()), name=Path(folder).name)


def _published(name, hidden, layers, heads, kv, ffn, nk, nv, tie) -> Qwen35Config:
    return Qwen35Config(
        vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=256, intermediate_size=ffn, linear_num_key_heads=nk,
        linear_num_value_heads=nv, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=tie, name=name,
    )  # fmt: skip


TINY_VOCAB = 512

PRESETS: dict[str, Qwen35Config] = {
    # The built-in tiny model: small enough for CPU tests, same structure as the published ones
    # (two groups of 3 GDN + 1 attention, GQA group 2, GDN value/key ratio 2, partial RoPE).
    "tiny": Qwen35Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=4096,
        eos_token_ids=(2, 0),
        name="tiny",
    ),  # fmt: skip
    "0.8b": _published("0.8b", 1024, 24, 8, 2, 3584, 16, 16, True),
    "4b": _published("4b", 2560, 32, 16, 4, 9216, 16, 32, True),
    "9b": _published("9b", 4096, 32, 16, 4, 12288, 16, 32, False),
    "27b": _published("27b", 5120, 64, 24, 4, 17408, 16, 48, False),
}


def preset(name: str) -> Qwen35Config:
    key = name.lower().removeprefix("qwen3.5-")
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key]
