"""Make the HF-transformers golden fixtures for qwen35-jax (tiny random Qwen3.5 models).

Command (remakes every fixture, bit for bit)::

    /work/golden-venv/bin/python tools/make_goldens.py --out tests/fixtures/golden

Dependencies: torch (CPU) and transformers==5.17.0, which ``pip install -e '.[golden]'`` provides,
plus numpy and safetensors. flash-linear-attention and causal-conv1d must NOT be importable: the
goldens are made on HF's torch fallback path for the Gated DeltaNet (the script refuses to run
otherwise). Everything is seeded and single-threaded, and the npz files are written with fixed zip
timestamps, so a rerun reproduces identical bytes with the same torch/transformers versions.

For every case the script builds a tiny random Qwen3.5 model (8 layers: 3x GDN + 1 full attention,
twice), randomises every norm weight, A_log and dt_bias (HF's default init hides (1+w) bugs), rounds
the parameters to what the checkpoint stores (BF16 everywhere except F32 `linear_attn.A_log` and
`linear_attn.norm.weight`, like the official checkpoints), saves an HF checkpoint folder, reloads it
in fp32 and in bf16 and records logits for

  (a) full prefill of several prompts (every position),
  (b) a prefill then 8 teacher-forced decode steps through the cache,
  (c) a chunked prefill that continues from the cache.

Layout of `<out>/<case>/`: config.json, *.safetensors [+ model.safetensors.index.json], golden.npz,
golden.json; `<out>/README.md` lists the cases.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import struct
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# transformers probes for a top-level package named `kernels` (HF hub kernels); the repo's own kernels/
# folder would shadow it when the repo root is on sys.path (`python -m tools.make_goldens`, or a shell
# started in the repo). Drop the repo root before importing transformers.
_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

EXPECTED_TRANSFORMERS = "5.17.0"
COMMAND = "python tools/make_goldens.py --out tests/fixtures/golden"
ATTN_IMPL = "eager"
GDN_PATH = "torch fallback (no flash-linear-attention)"
F32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")
ROPE = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2
# Init scales. Large Linear / conv1d stds make the random model ill-conditioned: with Linear std 0.08 and
# conv1d std 0.3, HF's own fp32 results disagree with themselves (full vs chunked prefill vs token-by-token
# decode) by up to ~2e-4 in the logits, mostly from the chunked GDN solve. With 0.05 / 0.1 that noise is
# ~1e-5 while every block still moves the logits by O(0.5) std (logits std ~1.3).
LINEAR_STD = 0.05  # every nn.Linear of the text model except an untied lm_head
CONV_STD = 0.1  # GDN depthwise conv1d
EMBED_STD = 0.15  # embed_tokens (= lm_head when tied)
LM_HEAD_STD = 0.15  # untied lm_head
NORM_STD = 0.3  # (1 + w) RMSNorms: w ~ N(0, NORM_STD)
DECODE_PROMPT_LEN = 40
DECODE_STEPS = 8
CHUNK_SIZES = (50, 37, 63)
SANITY_TOL_FP32 = 5e-5  # chunked / decode vs full-prefill logits, HF fp32 against itself


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    description: str
    tied: bool
    heads: int
    kv_heads: int
    lin_k_heads: int
    lin_v_heads: int
    vocab: int
    prefill_lengths: tuple[int, ...]
    layout: str = "text"  # "text" (Qwen3_5ForCausalLM) or "composite" (Qwen3_5ForConditionalGeneration)
    shards: int = 1
    covers: list[str] = field(default_factory=list)


CASES = [
    Case(
        name="tied_gqa2_ratio2",
        seed=1001,
        description="text-only Qwen3_5ForCausalLM, tied lm_head, 4 q heads / 2 kv heads (GQA group 2), "
        "GDN 2 key / 4 value heads (ratio 2), single safetensors file; long prompts cross the 64-token "
        "GDN chunk boundary several times",
        tied=True,
        heads=4,
        kv_heads=2,
        lin_k_heads=2,
        lin_v_heads=4,
        vocab=256,
        prefill_lengths=(1, 7, 63, 64, 65, 130, 300),
        covers=["tied", "gqa2", "gdn_ratio2", "text_layout", "single_file", "long_prefill"],
    ),
    Case(
        name="untied_gqa4_ratio1_sharded",
        seed=1002,
        description="text-only Qwen3_5ForCausalLM, untied lm_head, 4 q heads / 1 kv head (GQA group 4), "
        "GDN 2 key / 2 value heads (ratio 1), SHARDED checkpoint (index.json + 2 shards)",
        tied=False,
        heads=4,
        kv_heads=1,
        lin_k_heads=2,
        lin_v_heads=2,
        vocab=160,
        prefill_lengths=(1, 65, 130),
        layout="text",
        shards=2,
        covers=["untied", "gqa4", "gdn_ratio1", "text_layout", "sharded"],
    ),
    Case(
        name="tied_gqa1_ratio2",
        seed=1003,
        description="text-only Qwen3_5ForCausalLM, tied lm_head, 2 q heads / 2 kv heads (GQA group 1, "
        "i.e. MHA), GDN 2 key / 4 value heads (ratio 2), single safetensors file",
        tied=True,
        heads=2,
        kv_heads=2,
        lin_k_heads=2,
        lin_v_heads=4,
        vocab=176,
        prefill_lengths=(1, 64, 65, 130),
        covers=["tied", "gqa1", "gdn_ratio2", "text_layout", "single_file"],
    ),
    Case(
        name="composite_untied_gqa2",
        seed=1004,
        description="COMPOSITE Qwen3_5ForConditionalGeneration checkpoint (model_type qwen3_5, text_config, "
        "tiny vision tower under model.visual.*, text under model.language_model.*, extra mtp.* tensors "
        "that loaders must skip), untied lm_head, 4 q heads / 2 kv heads (GQA group 2), GDN 2 key / "
        "2 value heads (ratio 1)",
        tied=False,
        heads=4,
        kv_heads=2,
        lin_k_heads=2,
        lin_v_heads=2,
        vocab=192,
        prefill_lengths=(1, 65, 130),
        layout="composite",
        covers=["untied", "gqa2", "gdn_ratio1", "composite_layout", "vision_keys", "mtp_keys"],
    ),
]


# --------------------------------------------------------------------------------------------------
# config / model construction


def text_config_kwargs(case: Case) -> dict:
    return dict(
        vocab_size=case.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=case.lin_k_heads,
        linear_num_value_heads=case.lin_v_heads,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=dict(ROPE),
        attention_bias=False,
        tie_word_embeddings=case.tied,
        eos_token_id=case.vocab - 1,
    )


def vision_config_kwargs() -> dict:
    return dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,  # = text hidden size
        num_position_embeddings=16,
    )


def build_model(case: Case) -> torch.nn.Module:
    if case.layout == "text":
        cfg = Qwen3_5TextConfig(**text_config_kwargs(case))
        cls = Qwen3_5ForCausalLM
    else:
        v = case.vocab
        cfg = Qwen3_5Config(
            text_config=text_config_kwargs(case),
            vision_config=vision_config_kwargs(),
            # special ids must fit the tiny vocab; the golden prompts never use images
            image_token_id=v - 4,
            video_token_id=v - 3,
            vision_start_token_id=v - 6,
            vision_end_token_id=v - 5,
            tie_word_embeddings=case.tied,
        )
        cls = Qwen3_5ForConditionalGeneration
    cfg._attn_implementation = ATTN_IMPL
    torch.manual_seed(case.seed)
    model = cls(cfg).to(torch.float32)
    model.eval()
    return model


def stored_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(F32_SUFFIXES) else torch.bfloat16


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded values, then round to what the checkpoint stores."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            s = p.shape
            if ".visual." in name or name.startswith("visual."):
                if "norm" in name and name.endswith(".weight"):
                    val = normal(s, 0.1, 1.0)
                elif name.endswith(".bias"):
                    val = normal(s, 0.02)
                else:
                    val = normal(s, 0.05)
            elif name.endswith("linear_attn.A_log"):
                val = uniform(s, 1.0, 16.0).log()
            elif name.endswith("linear_attn.dt_bias"):
                val = normal(s, 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                val = uniform(s, 0.5, 1.5)  # plain w * norm(o): not zero-centred
            elif name.endswith("norm.weight"):
                # input/post_attention layernorm, final norm, q_norm, k_norm: (1 + w)
                val = normal(s, NORM_STD)
            elif name.endswith("conv1d.weight"):
                val = normal(s, CONV_STD)
            elif name.endswith("embed_tokens.weight"):
                val = normal(s, EMBED_STD)
            elif name == "lm_head.weight":
                val = normal(s, LM_HEAD_STD)
            elif name.endswith(".weight") and p.ndim == 2:
                val = normal(s, LINEAR_STD)
            else:
                raise ValueError(f"no randomisation rule for parameter {name} {tuple(s)}")
            val = val.to(stored_dtype(name)).to(torch.float32)
            p.copy_(val)


# --------------------------------------------------------------------------------------------------
# checkpoint writing


def _st_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def mtp_tensors(case: Case, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Plausibly shaped MTP tensors (the official checkpoints ship these; HF and our loader skip them)."""
    hs, D, H, KV, ffn = 64, 32, case.heads, case.kv_heads, 128
    shapes = {
        "mtp.fc.weight": (hs, 2 * hs),
        "mtp.pre_fc_norm_embedding.weight": (hs,),
        "mtp.pre_fc_norm_hidden.weight": (hs,),
        "mtp.norm.weight": (hs,),
        "mtp.layers.0.input_layernorm.weight": (hs,),
        "mtp.layers.0.post_attention_layernorm.weight": (hs,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * H * D, hs),
        "mtp.layers.0.self_attn.k_proj.weight": (KV * D, hs),
        "mtp.layers.0.self_attn.v_proj.weight": (KV * D, hs),
        "mtp.layers.0.self_attn.o_proj.weight": (hs, H * D),
        "mtp.layers.0.self_attn.q_norm.weight": (D,),
        "mtp.layers.0.self_attn.k_norm.weight": (D,),
        "mtp.layers.0.mlp.gate_proj.weight": (ffn, hs),
        "mtp.layers.0.mlp.up_proj.weight": (ffn, hs),
        "mtp.layers.0.mlp.down_proj.weight": (hs, ffn),
    }
    out = {}
    for k in sorted(shapes):
        std = 0.3 if len(shapes[k]) == 1 else LINEAR_STD
        out[k] = (torch.randn(shapes[k], generator=g) * std).to(torch.bfloat16)
    return out


def save_checkpoint(model: torch.nn.Module, case: Case, out: Path) -> list[str]:
    """save_pretrained, then rewrite the safetensors with the official dtypes (BF16, F32 A_log/norm)."""
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    if case.shards == 1:
        model.save_pretrained(out, safe_serialization=True)
    else:
        # fp32 on save; a bit more than half the model per shard gives exactly 2 shards
        model.save_pretrained(out, safe_serialization=True, max_shard_size=int(n_bytes * 0.6))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # like the official checkpoints (this is only a default; the goldens pass dtype explicitly)
    cfg["dtype"] = "bfloat16"
    if "text_config" in cfg:
        cfg["text_config"]["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()

    index_path = out / "model.safetensors.index.json"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == case.shards, (case.name, files)
    g = torch.Generator().manual_seed(case.seed + 7)
    extra = mtp_tensors(case, g) if case.layout == "composite" else {}
    if extra:
        assert case.shards == 1
    total = 0
    weight_map = {}
    for fname in files:
        sd = load_file(out / fname)
        new = {k: v.to(stored_dtype(k)).contiguous() for k, v in sd.items()}
        if fname == files[-1]:
            new.update(extra)
        for k, v in new.items():
            total += v.numel() * v.element_size()
            weight_map[k] = fname
        save_file(new, out / fname, metadata={"format": "pt"})
        os.chmod(out / fname, 0o644)
    if case.shards > 1:
        idx = json.loads(index_path.read_text())
        idx["metadata"] = {"total_size": total}
        idx["weight_map"] = dict(sorted(weight_map.items()))
        index_path.write_text(json.dumps(idx, indent=2, sort_keys=True) + "\n")
    else:
        assert not index_path.exists()
    return files


def check_layout(case: Case, out: Path, files: list[str]) -> dict:
    """Assert the stored dtypes and key prefixes; return a small summary for golden.json."""
    keys: dict[str, str] = {}
    for fname in files:
        for k, info in _st_header(out / fname).items():
            if k != "__metadata__":
                keys[k] = info["dtype"]
    for k, dt in keys.items():
        want = "F32" if k.endswith(F32_SUFFIXES) else "BF16"
        assert dt == want, (case.name, k, dt, want)
    text_prefix = "model.language_model." if case.layout == "composite" else "model."
    for k in keys:
        ok = k.startswith(text_prefix) or k == "lm_head.weight"
        if case.layout == "composite":
            ok = ok or k.startswith("model.visual.") or k.startswith("mtp.")
        assert ok, (case.name, k)
    assert ("lm_head.weight" in keys) == (not case.tied), case.name
    if case.layout == "composite":
        assert any(k.startswith("model.visual.") for k in keys)
        assert any(k.startswith("mtp.") for k in keys)
    n_f32 = sum(1 for dt in keys.values() if dt == "F32")
    assert n_f32 == 2 * LAYER_TYPES.count("linear_attention"), n_f32
    cfg = json.loads((out / "config.json").read_text())
    want_type = "qwen3_5" if case.layout == "composite" else "qwen3_5_text"
    assert cfg["model_type"] == want_type, cfg["model_type"]
    return {
        "files": files,
        "num_tensors": len(keys),
        "f32_tensors": n_f32,
        "text_prefix": text_prefix,
        "has_lm_head": "lm_head.weight" in keys,
        "num_visual_tensors": sum(k.startswith("model.visual.") for k in keys),
        "num_mtp_tensors": sum(k.startswith("mtp.") for k in keys),
    }


# --------------------------------------------------------------------------------------------------
# HF runs


def model_class_name(case: Case) -> str:
    return "Qwen3_5ForConditionalGeneration" if case.layout == "composite" else "Qwen3_5ForCausalLM"


def load(case: Case, out: Path, dtype: torch.dtype) -> torch.nn.Module:
    cls = Qwen3_5ForConditionalGeneration if case.layout == "composite" else Qwen3_5ForCausalLM
    model, info = cls.from_pretrained(out, dtype=dtype, attn_implementation=ATTN_IMPL, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    model.eval()
    return model


def _logits(out) -> np.ndarray:
    return out.logits[0].to(torch.float32).numpy().copy()


@torch.no_grad()
def run_prefill(model, tokens: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    return _logits(model(input_ids=ids, use_cache=False))


@torch.no_grad()
def run_decode(model, prompt: np.ndarray, steps: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    out = model(input_ids=ids, use_cache=True)
    rows = [_logits(out)[-1]]
    cache = out.past_key_values
    for t in steps:
        out = model(input_ids=torch.tensor([[int(t)]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(_logits(out)[-1])
    return np.stack(rows)


@torch.no_grad()
def run_chunked(model, tokens: np.ndarray, sizes: tuple[int, ...]) -> np.ndarray:
    cache = None
    parts, start = [], 0
    for n in sizes:
        ids = torch.from_numpy(tokens[start : start + n].astype(np.int64))[None]
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        parts.append(_logits(out))
        start += n
    assert start == len(tokens)
    return np.concatenate(parts)


def run_all(model, inputs: dict) -> dict[str, np.ndarray]:
    res = {}
    for i, toks in enumerate(inputs["prefill"]):
        res[f"prefill_{i}"] = run_prefill(model, toks)
    res["decode"] = run_decode(model, inputs["decode_prompt"], inputs["decode_tokens"])
    res["chunk"] = run_chunked(model, inputs["chunk_tokens"], CHUNK_SIZES)
    return res


def make_inputs(case: Case) -> dict:
    rng = np.random.default_rng(case.seed)
    return {
        "prefill": [rng.integers(0, case.vocab, size=n).astype(np.int32) for n in case.prefill_lengths],
        "decode_prompt": rng.integers(0, case.vocab, size=DECODE_PROMPT_LEN).astype(np.int32),
        "decode_tokens": rng.integers(0, case.vocab, size=DECODE_STEPS).astype(np.int32),
        "chunk_tokens": rng.integers(0, case.vocab, size=sum(CHUNK_SIZES)).astype(np.int32),
    }


def sanity_checks(model, inputs: dict, res: dict) -> dict:
    """HF fp32 against itself: chunked prefill and cached decode vs one full prefill."""
    full_chunk = run_prefill(model, inputs["chunk_tokens"])
    seq = np.concatenate([inputs["decode_prompt"], inputs["decode_tokens"]])
    full_dec = run_prefill(model, seq)[len(inputs["decode_prompt"]) - 1 :]
    d_chunk = float(np.abs(full_chunk - res["chunk"]).max())
    d_dec = float(np.abs(full_dec - res["decode"]).max())
    assert d_chunk < SANITY_TOL_FP32, d_chunk
    assert d_dec < SANITY_TOL_FP32, d_dec
    return {"fp32_chunked_vs_full_max_abs": d_chunk, "fp32_decode_vs_full_max_abs": d_dec}


# --------------------------------------------------------------------------------------------------
# outputs


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed equivalent with fixed zip timestamps, so reruns give identical bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def make_case(case: Case, root: Path) -> dict:
    out = root / case.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    model = build_model(case)
    randomise_(model, case.seed)
    files = save_checkpoint(model, case, out)
    layout = check_layout(case, out, files)

    inputs = make_inputs(case)
    m32 = load(case, out, torch.float32)
    # the reloaded fp32 model holds exactly the randomised (stored-precision) values
    ref = dict(model.named_parameters())
    for k, p in m32.named_parameters():
        assert torch.equal(p, ref[k]), k
    del model, ref
    r32 = run_all(m32, inputs)
    checks = sanity_checks(m32, inputs, r32)
    if case.layout == "composite":
        # the text-only class loads the composite checkpoint (renaming model.language_model -> model)
        lm = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=ATTN_IMPL)
        assert type(lm).__name__ == "Qwen3_5ForCausalLM", type(lm)
        last = len(inputs["prefill"]) - 1
        d = float(np.abs(run_prefill(lm.eval(), inputs["prefill"][last]) - r32[f"prefill_{last}"]).max())
        checks["fp32_causallm_class_vs_composite_max_abs"] = d
        assert d < 1e-6, d
        del lm
    del m32

    m16 = load(case, out, torch.bfloat16)
    a_log = [p for k, p in m16.named_parameters() if k.endswith("linear_attn.A_log")][0]
    bf16_a_log_dtype = str(a_log.dtype).replace("torch.", "")
    r16 = run_all(m16, inputs)
    del m16

    arrays: dict[str, np.ndarray] = {
        "prefill_lengths": np.asarray(case.prefill_lengths, dtype=np.int32),
        "decode_prompt": inputs["decode_prompt"],
        "decode_tokens": inputs["decode_tokens"],
        "chunk_tokens": inputs["chunk_tokens"],
        "chunk_sizes": np.asarray(CHUNK_SIZES, dtype=np.int32),
    }
    for i, toks in enumerate(inputs["prefill"]):
        arrays[f"prefill_tokens_{i}"] = toks
        arrays[f"prefill_logits_fp32_{i}"] = r32[f"prefill_{i}"]
        arrays[f"prefill_logits_bf16_{i}"] = r16[f"prefill_{i}"]
    for key in ("decode", "chunk"):
        arrays[f"{key}_logits_fp32"] = r32[key]
        arrays[f"{key}_logits_bf16"] = r16[key]
    for k, a in arrays.items():
        assert a.dtype in (np.int32, np.float32), (k, a.dtype)
        if a.dtype == np.float32:
            assert np.isfinite(a).all(), k
    write_npz(out / "golden.npz", arrays)

    all32 = np.concatenate([r32[f"prefill_{i}"] for i in range(len(inputs["prefill"]))])
    all16 = np.concatenate([r16[f"prefill_{i}"] for i in range(len(inputs["prefill"]))])
    stats = {
        "prefill_logits_fp32_std": round(float(all32.std()), 4),
        "prefill_logits_fp32_per_position_std_mean": round(float(all32.std(axis=-1).mean()), 4),
        "prefill_bf16_vs_fp32_max_abs": round(float(np.abs(all16 - all32).max()), 4),
        "prefill_bf16_vs_fp32_argmax_agreement": round(float((all16.argmax(-1) == all32.argmax(-1)).mean()), 4),
    }
    meta = {
        "case": case.name,
        "description": case.description,
        "covers": case.covers,
        "seed": case.seed,
        "command": COMMAND,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "attn_implementation": ATTN_IMPL,
        "gdn_path": GDN_PATH,
        "model_class": model_class_name(case),
        "layout": case.layout,
        "checkpoint": layout,
        "dtypes": {
            "fp32": "loaded with dtype=torch.float32 (bf16-stored tensors upcast exactly; A_log and "
            "linear_attn.norm.weight keep their stored F32 values)",
            "bf16": "loaded with dtype=torch.bfloat16 (HF casts the F32 A_log / linear_attn.norm.weight "
            f"to {bf16_a_log_dtype} on load); logits upcast from bf16 to float32",
        },
        "config": {
            "tie_word_embeddings": case.tied,
            "num_attention_heads": case.heads,
            "num_key_value_heads": case.kv_heads,
            "gqa_group": case.heads // case.kv_heads,
            "linear_num_key_heads": case.lin_k_heads,
            "linear_num_value_heads": case.lin_v_heads,
            "gdn_value_key_ratio": case.lin_v_heads // case.lin_k_heads,
            "vocab_size": case.vocab,
            "layer_types": list(LAYER_TYPES),
        },
        "init": {
            "linear_std": LINEAR_STD,
            "embed_std": EMBED_STD,
            "lm_head_std": LM_HEAD_STD if not case.tied else "tied",
            "conv1d_std": CONV_STD,
            "rmsnorm_w": f"normal(0, {NORM_STD}) used as (1 + w)",
            "gated_norm_w": "uniform(0.5, 1.5)",
            "A_log": "log(uniform(1, 16))",
            "dt_bias": "normal(0, 1)",
            "rounding": "all params rounded to bf16 except A_log and linear_attn.norm.weight (F32)",
        },
        "cases": {
            "prefill_lengths": list(case.prefill_lengths),
            "decode": f"prefill {DECODE_PROMPT_LEN} tokens, then {DECODE_STEPS} teacher-forced single-token "
            "steps through past_key_values; row 0 = logits of the prefill's last position",
            "chunk_sizes": list(CHUNK_SIZES),
        },
        "sanity": checks,
        "stats": stats,
    }
    (out / "golden.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def write_readme(root: Path, metas: list[dict]) -> None:
    lines = [
        "# HF golden fixtures (tiny random Qwen3.5 models)",
        "",
        "Made by `tools/make_goldens.py` with transformers "
        f"{metas[0]['transformers_version']} and torch {metas[0]['torch_version']} on CPU, "
        f"`attn_implementation={ATTN_IMPL!r}`, GDN on the {GDN_PATH}. Remake (bit for bit) with:",
        "",
        "```",
        "/work/golden-venv/bin/python tools/make_goldens.py --out tests/fixtures/golden",
        "# or, in any env with `pip install -e '.[golden]'` (and no flash-linear-attention):",
        COMMAND,
        "```",
        "",
        "Every model: hidden 64, 8 layers (3x linear_attention + full_attention, twice), head_dim 32, "
        "partial rotary 0.25 (rotary dim 8), theta 1e7, mrope_section [2,1,1] interleaved, GDN key/value "
        "head dim 16, conv kernel 4, FFN 128, max_position_embeddings 4096. Norm weights, A_log and "
        "dt_bias are randomised. Checkpoints store `linear_attn.A_log` and `linear_attn.norm.weight` "
        "as F32 and everything else as BF16; the fp32 goldens use exactly the stored values.",
        "",
        "| case | layout | lm_head | heads / kv (group) | GDN nk / nv (ratio) | vocab | prefill lengths |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in metas:
        c = m["config"]
        n_files = len(m["checkpoint"]["files"])
        lay = m["layout"] + (f", {n_files} shards" if n_files > 1 else "")
        if m["layout"] == "composite":
            lay += " (+ model.visual.*, mtp.*)"
        lines.append(
            f"| `{m['case']}` | {lay} | {'tied' if c['tie_word_embeddings'] else 'untied'} | "
            f"{c['num_attention_heads']} / {c['num_key_value_heads']} ({c['gqa_group']}) | "
            f"{c['linear_num_key_heads']} / {c['linear_num_value_heads']} ({c['gdn_value_key_ratio']}) | "
            f"{c['vocab_size']} | {', '.join(map(str, m['cases']['prefill_lengths']))} |"
        )
    lines += [
        "",
        "Each case folder holds an HF checkpoint (config.json, *.safetensors [+ index]), `golden.json` "
        "(versions, description, seed, init, sanity checks) and `golden.npz`:",
        "",
        "- `prefill_lengths` int32 [n]; `prefill_tokens_{i}` int32 [L_i]; `prefill_logits_fp32_{i}` / "
        "`prefill_logits_bf16_{i}` float32 [L_i, V] (logits at every position; bf16 ones upcast)",
        f"- `decode_prompt` int32 [{DECODE_PROMPT_LEN}]; `decode_tokens` int32 [{DECODE_STEPS}]; "
        f"`decode_logits_fp32` / `decode_logits_bf16` float32 [{DECODE_STEPS + 1}, V]: row 0 is the "
        "prompt's last position, row j the logits after feeding `decode_tokens[j-1]` through the cache",
        f"- `chunk_tokens` int32 [{sum(CHUNK_SIZES)}]; `chunk_sizes` int32 {list(CHUNK_SIZES)}; "
        "`chunk_logits_fp32` / `chunk_logits_bf16` float32 [Lc, V]: every position, the prompt fed in "
        "chunks that continue from the cache",
        "",
        "fp32 goldens are loaded with `dtype=torch.float32`, bf16 ones with `dtype=torch.bfloat16` (HF then "
        "rounds the F32 A_log / gated-norm weight to bf16).",
        "",
    ]
    (root / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder, e.g. tests/fixtures/golden")
    ap.add_argument("--case", action="append", help="only this case (repeatable); default: all")
    args = ap.parse_args(argv)

    for mod in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(mod) is not None:
            sys.exit(f"{mod} is importable: goldens must use HF's torch fallback path; use an env without it")
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__} found; goldens pin {EXPECTED_TRANSFORMERS}")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    cases = [c for c in CASES if not args.case or c.name in args.case]
    args.out.mkdir(parents=True, exist_ok=True)
    metas = []
    for case in cases:
        meta = make_case(case, args.out)
        print(f"{case.name}: {json.dumps(meta['sanity'])} {json.dumps(meta['stats'])}", flush=True)
        metas.append(meta)
    if not args.case:
        write_readme(args.out, metas)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
