"""Metrics for comparing engine logits with the HF goldens in tests/fixtures/golden.

`load_golden(case_dir)` reads one fixture case; `golden_runs(golden)` lists the token sequences to feed the engine
with the HF rows they must match; `logprob_deltas`, `argmax_checks` and `bf16_stats` measure one comparison;
`gate_report` turns the measurements into the gate lines (docs/accuracy.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FP32_MAX_ABS_LOGIT = 2e-4  # fp32 engine vs HF fp32, tiny models
TOP_LOGPROBS = 8  # |Δlogprob| is taken over the candidate's top-8 tokens
ARGMAX_TOP_K = 64  # the candidate's argmax must be in the reference's top-64 ...
ARGMAX_TOL_NAT = 0.20  # ... and within 0.20 nat of the reference's best
BF16_MEAN = 0.06
BF16_P99 = 0.20
CALIB_FACTOR = 1.5  # random models: engine bf16 within 1.5x HF bf16's own error (vs HF fp32) ...
CALIB_MEAN_SLACK = 0.01  # ... plus 0.01 on the mean
CALIB_P99_SLACK = 0.02  # ... plus 0.02 on p99


@dataclass(frozen=True)
class GoldenRun:
    """One engine call: feed `tokens` as a single prefill; logits rows [start:] match `ref_fp32` / `ref_bf16`."""

    label: str
    tokens: np.ndarray
    start: int
    ref_fp32: np.ndarray
    ref_bf16: np.ndarray


def load_golden(case_dir: str | Path) -> dict:
    """{'name', 'dir', 'meta' (golden.json), 'arrays' (golden.npz as a dict of numpy arrays)}."""
    case_dir = Path(case_dir)
    with np.load(case_dir / "golden.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads((case_dir / "golden.json").read_text())
    return {"name": case_dir.name, "dir": case_dir, "meta": meta, "arrays": arrays}


def golden_runs(golden: dict) -> list[GoldenRun]:
    """Every prefill prompt, the teacher-forced decode and the chunked prompt, each as one full prefill.

    Decode: prefilling prompt + decode_tokens at once gives, by causality, the same logits as prefill + one-token
    steps through the cache; rows len(prompt)-1 .. end are the 9 golden rows. Chunked: likewise the same as one
    prefill of all chunk_tokens.
    """
    a = golden["arrays"]
    runs = [
        GoldenRun(
            f"prefill L={int(n)}",
            a[f"prefill_tokens_{i}"],
            0,
            a[f"prefill_logits_fp32_{i}"],
            a[f"prefill_logits_bf16_{i}"],
        )
        for i, n in enumerate(a["prefill_lengths"])
    ]
    prompt, steps = a["decode_prompt"], a["decode_tokens"]
    runs.append(
        GoldenRun(f"decode {len(prompt)}+{len(steps)}", np.concatenate([prompt, steps]), len(prompt) - 1,
                  a["decode_logits_fp32"], a["decode_logits_bf16"])
    )  # fmt: skip
    sizes = "+".join(str(int(s)) for s in a["chunk_sizes"])
    runs.append(GoldenRun(f"chunked {sizes}", a["chunk_tokens"], 0, a["chunk_logits_fp32"], a["chunk_logits_bf16"]))
    return runs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def logprob_deltas(ours_logits: np.ndarray, ref_logits: np.ndarray, top: int = TOP_LOGPROBS) -> np.ndarray:
    """|logprob(ours) - logprob(ref)| [L, top] at each position's `top` most likely tokens under `ours`."""
    ours, ref = log_softmax(ours_logits), log_softmax(ref_logits)
    idx = np.argsort(-ours, axis=-1, kind="stable")[:, :top]
    return np.abs(np.take_along_axis(ours, idx, -1) - np.take_along_axis(ref, idx, -1))


def argmax_checks(ours_logits: np.ndarray, ref_logits: np.ndarray, top_k: int = ARGMAX_TOP_K,
                  tol: float = ARGMAX_TOL_NAT) -> dict:  # fmt: skip
    """Per position: our argmax's rank under ref, its gap (nat) below ref's best, and whether it passes.

    top_k is capped at the vocabulary size (tiny models have a few hundred tokens).
    """
    ours, ref = log_softmax(ours_logits), log_softmax(ref_logits)
    ours_best = ours.argmax(-1)
    ref_at_ours = np.take_along_axis(ref, ours_best[:, None], -1)[:, 0]
    rank = (ref > ref_at_ours[:, None]).sum(-1)  # 0 = ref's best too
    gap = ref.max(-1) - ref_at_ours
    ok = (rank < min(top_k, ref.shape[-1])) & (gap <= tol)
    return {"ours_argmax": ours_best, "ref_argmax": ref.argmax(-1), "rank": rank, "gap": gap, "ok": ok}


def bf16_stats(ours_logits: np.ndarray, ref_logits: np.ndarray, top: int = TOP_LOGPROBS) -> dict:
    """Pooled over all positions: |Δlogprob| mean / p99 / max over (position, top-8 token) pairs, argmax misses."""
    d = logprob_deltas(ours_logits, ref_logits, top)
    am = argmax_checks(ours_logits, ref_logits)
    return {
        "positions": int(d.shape[0]),
        "mean": float(d.mean()),
        "p99": float(np.percentile(d, 99)),
        "max": float(d.max()),
        "misses": int((~am["ok"]).sum()),
        "argmax_agree": float((am["ours_argmax"] == am["ref_argmax"]).mean()),
        "worst_gap": float(am["gap"].max()),
    }


def gate_report(fp32_max_abs: float, engine_vs_hf_bf16: dict, engine_vs_hf_fp32: dict, hf_bf16_vs_hf_fp32: dict
                ) -> list[tuple[str, float, float, bool]]:  # fmt: skip
    """The bf16 gate (docs/accuracy.md) as (check, value, limit, passed) lines.

    engine_vs_hf_bf16: engine bf16 vs HF bf16 (same dtype); engine_vs_hf_fp32 / hf_bf16_vs_hf_fp32: the calibrated
    form, both bf16 paths against HF fp32 as truth. Stats dicts come from bf16_stats.
    """
    e, c, h = engine_vs_hf_bf16, engine_vs_hf_fp32, hf_bf16_vs_hf_fp32
    lines = [
        ("fp32 max |dlogit|", fp32_max_abs, FP32_MAX_ABS_LOGIT),
        ("bf16 argmax misses", e["misses"], 0),
        ("bf16 mean |dlogprob|", e["mean"], BF16_MEAN),
        ("bf16 p99 |dlogprob|", e["p99"], BF16_P99),
        ("calibrated misses", c["misses"], CALIB_FACTOR * h["misses"]),
        ("calibrated mean", c["mean"], CALIB_FACTOR * h["mean"] + CALIB_MEAN_SLACK),
        ("calibrated p99", c["p99"], CALIB_FACTOR * h["p99"] + CALIB_P99_SLACK),
    ]
    return [(name, float(v), float(lim), bool(v <= lim)) for name, v, lim in lines]
