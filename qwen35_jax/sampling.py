"""Sampling parameters and a host-side sampler for the single-request API path.

The engine samples on the device, per row (serving/device_sampling.py); this host version serves
`LoadedModel.generate`, and is the oracle the device sampler is tested against.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_LOGIT_BIAS = 256  # entries per request: the sampler program takes them as fixed-size arrays


def biased(logits: np.ndarray, params: SamplingParams, output_ids=(), prompt_ids=()) -> np.ndarray:
    """The logits the pick is made from, in the order the device sampler applies them: the repetition penalty
    over the tokens of `prompt_ids` and `output_ids` (the request's output so far), the presence and frequency
    penalties over `output_ids`, then logit_bias."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=out.size)[: out.size]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[np.asarray(prompt_ids, np.int64)] = True
        penalty = params.repetition_penalty
        out = np.where(seen, np.where(out > 0, out / penalty, out * penalty), out)
    out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token, value in params.logit_bias:
        out[token] += value
    return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    # (token id, value) pairs added to the logits before the pick, greedy or sampled (OpenAI's logit_bias);
    # logprobs stay those of the unbiased distribution.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties, over the request's own output tokens so far: each token's logit loses
    # frequency_penalty x its count, and presence_penalty once if it occurred.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (from the CTRL paper), over the prompt's tokens and the output's: a token that occurred has its logit
    # divided by the penalty where it is positive and multiplied by it where it is not. 1 is neutral.
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top_k, top_p and min_p (in that order), renormalised."""
    scaled = logits.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if params.top_k:
        keep[order[params.top_k :]] = False
    cumulative = np.cumsum(probs[order]) - probs[order]
    keep[order[cumulative >= params.top_p]] = False
    keep &= probs >= params.min_p * probs.max()
    keep[order[0]] = True
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def sample_host(logits: np.ndarray, params: SamplingParams, step: int, output_ids=(), prompt_ids=()) -> int:
    logits = biased(logits, params, output_ids, prompt_ids)
    if params.greedy:
        return int(np.argmax(logits))
    rng = np.random.default_rng([params.seed % 2**64, step])
    return int(rng.choice(len(logits), p=filtered_probs(logits, params)))
