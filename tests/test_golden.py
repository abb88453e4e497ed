"""Golden parity against HF transformers 5.17 on tiny random models (fixtures in tests/fixtures/golden).

Each golden path is computed the way serving computes it: a full prefill, prefill then one-token decode
steps through the caches, and chunked prefill continuing from cached KV and GDN state.
Tolerances (the gate of docs/accuracy.md):
- fp32: max |Δlogit| <= 2e-4. Both sides are fp32 end to end; what is left is summation order
  (chunked GDN solve, GEMM blocking), measured at <= 2e-5 here, and HF disagrees with itself between
  its own full and chunked paths by up to ~1e-5 on these models.
- bf16: the engine's bf16 against HF's bf16 (mean/p99 of |Δlogprob| over the engine's top-8 tokens,
  0.06/0.20) and the calibrated form against HF fp32 as truth (within 1.5x of HF bf16's own error,
  plus 0.01/0.02), since random models are far more sensitive to bf16 rounding than trained ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qwen35_jax.api import load_model
from qwen35_jax.golden import BF16_MEAN, BF16_P99, FP32_MAX_ABS_LOGIT, bf16_stats, gate_report, load_golden
from qwen35_jax.serving.factory import enable_compile_cache

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.npz").is_file())
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module", autouse=True)
def session_compile_cache(compile_cache_dir):
    """Writes this file's programs to the session's XLA cache, where the accuracy notebook, run after this file on
    the same worker (conftest.SAME_WORKER), loads the same full prefills instead of compiling them (~70 s of the
    2-core CPU). No engine has enabled the cache yet when this file runs first on its worker."""
    enable_compile_cache(compile_cache_dir)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return load_golden(GOLDEN / request.param)


def engine_paths(model, arrays) -> dict[str, np.ndarray]:
    """Engine logits for each golden path, computed as serving computes it."""
    out = {}
    for i in range(len(arrays["prefill_lengths"])):
        out[f"prefill_{i}"] = model.logits(arrays[f"prefill_tokens_{i}"])
    prompt = list(arrays["decode_prompt"])
    tokens = prompt + list(arrays["decode_tokens"])
    out["decode"] = model.logits_incremental(tokens, decode_from=len(prompt))[len(prompt) - 1 :]
    out["chunk"] = model.logits_incremental(list(arrays["chunk_tokens"]), chunk_sizes=list(arrays["chunk_sizes"]))
    return out


def hf_paths(arrays, dtype: str) -> dict[str, np.ndarray]:
    out = {f"prefill_{i}": arrays[f"prefill_logits_{dtype}_{i}"] for i in range(len(arrays["prefill_lengths"]))}
    out["decode"] = arrays[f"decode_logits_{dtype}"]
    out["chunk"] = arrays[f"chunk_logits_{dtype}"]
    return out


def test_fp32_matches_hf(case):
    model = load_model(case["dir"], dtype="float32")
    ours, ref = engine_paths(model, case["arrays"]), hf_paths(case["arrays"], "fp32")
    errors = {name: float(np.abs(ours[name] - ref[name]).max()) for name in ref}
    print(case["name"], "fp32 max|dlogit|", errors)
    assert max(errors.values()) <= FP32_MAX_ABS_LOGIT, errors


def test_bf16_gate(case):
    model = load_model(case["dir"], dtype="bfloat16")
    arrays = case["arrays"]
    ours, hf_bf16, hf_fp32 = engine_paths(model, arrays), hf_paths(arrays, "bf16"), hf_paths(arrays, "fp32")

    def pooled(a, b):
        names = list(b)
        return bf16_stats(np.concatenate([a[n] for n in names]), np.concatenate([b[n] for n in names]))

    direct, calibrated, hf_own = pooled(ours, hf_bf16), pooled(ours, hf_fp32), pooled(hf_bf16, hf_fp32)
    print(case["name"], "bf16 vs HF bf16", direct, "| vs HF fp32", calibrated, "| HF bf16 vs fp32", hf_own)
    assert direct["mean"] <= BF16_MEAN and direct["p99"] <= BF16_P99, direct
    assert direct["misses"] == 0, direct  # on these tiny models even the trained-checkpoint form holds
    failed = [line for line in gate_report(0.0, direct, calibrated, hf_own) if not line[3]]
    assert not failed, failed
