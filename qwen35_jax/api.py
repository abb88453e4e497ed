"""The stable Python API: `load_model(path_or_preset)` -> LoadedModel with .config, .tokenizer, .logits, .generate.

`.logits` is one full prefill; `.generate` is a single-request loop (prefill, then one-token decode steps)
over the same model code, weight layout and kernels the engine uses. Serving many requests goes through
serving/engine.py.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.batch import DecodeSide, PrefillSide, StepInputs
from qwen35_jax.cache import CacheSpec, new_cache
from qwen35_jax.config import PRESETS, Qwen35Config, load_config, preset
from qwen35_jax.kernels import Mixers, mixers
from qwen35_jax.model import ModelDef, abstract_model, forward, layout_for_platform
from qwen35_jax.sampling import SamplingParams, sample_host
from qwen35_jax.weights import is_orbax_folder, load_orbax, load_safetensors, random_params

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
TINY_ASSETS = Path(__file__).parent / "assets" / "tiny"


def resolve_dtype(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_kernels(platform: str | None = None) -> str:
    """`pallas` on a GPU (its GPU tests and the bf16 golden gate hold there: docs/kernels.md), `ref` elsewhere."""
    return "pallas" if (platform or jax.default_backend()) == "gpu" else "ref"


@functools.partial(jax.jit, static_argnames=("model", "mixer_set", "all_prefill_logits"), donate_argnames=("cache",))
def step(model: ModelDef, params, cache, inputs: StepInputs, mixer_set: Mixers, all_prefill_logits: bool = False):
    """The one compiled step: jit specialises it per (bucket shapes, side presence, logits mode)."""
    return forward(model, params, cache, inputs, mixer_set, all_prefill_logits)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class LoadedModel:
    """A model ready to run: config, params in the platform's layout (`model.layout_for_platform`), the kernel set."""

    def __init__(self, cfg: Qwen35Config, params, dtype, tokenizer=None, kernels: str = "ref", page_size: int = 16):
        self.config = cfg
        self.params = layout_for_platform(params)
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.kernels = mixers(kernels)
        self.page_size = page_size
        # The GDN states' storage in this API's caches (`cache.SSM_DTYPES`), as `--mamba-ssm-cache-dtype` sets the
        # engine's: the golden gate checks either.
        self.ssm_dtype = "float32"
        self.model_def, _ = abstract_model(cfg, dtype)

    def _check_ids(self, token_ids) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _single_cache(self, num_tokens: int):
        # A power-of-two page count keeps the set of compiled shapes small across prompt lengths.
        pages = max(8, 1 << (-(-num_tokens // self.page_size) - 1).bit_length())
        spec = CacheSpec(num_pages=pages + 1, page_size=self.page_size, num_slots=2, ssm_dtype=self.ssm_dtype)
        page_table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None, :]
        return new_cache(self.config, spec, self.dtype), page_table

    def _prefill_inputs(self, ids: list[int], start: int, bucket: int, page_table) -> StepInputs:
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, : len(ids)] = ids
        side = PrefillSide(
            tokens=jnp.asarray(tokens), start=jnp.array([start], jnp.int32),
            lengths=jnp.array([len(ids)], jnp.int32), slots=jnp.zeros(1, jnp.int32), page_table=page_table,
        )  # fmt: skip
        return StepInputs(decode=None, prefill=side)

    def logits(self, token_ids) -> np.ndarray:
        """fp32 logits [len(token_ids), vocab], computed as one full prefill."""
        ids = self._check_ids(token_ids)
        cache, page_table = self._single_cache(len(ids))
        inputs = self._prefill_inputs(ids, 0, _round_up(len(ids), 64), page_table)
        out, _ = step(self.model_def, self.params, cache, inputs, self.kernels, all_prefill_logits=True)
        return np.asarray(out[: len(ids)], dtype=np.float32)

    def logits_incremental(self, token_ids, chunk_sizes=(), decode_from: int | None = None) -> np.ndarray:
        """fp32 logits at every position, computed the way serving does: prefill chunks of the given sizes,
        each continuing from the cached state, then (from index decode_from on) one-token decode steps.
        The sizes need not cover the prompt: the rest up to decode_from is one last chunk."""
        ids = self._check_ids(token_ids)
        decode_from = len(ids) if decode_from is None else decode_from
        cache, page_table = self._single_cache(len(ids))
        rows, start = [], 0
        for size in [*chunk_sizes, decode_from - sum(chunk_sizes)]:
            if size <= 0:
                continue
            inputs = self._prefill_inputs(ids[start : start + size], start, _round_up(size, 16), page_table)
            logits, cache = step(self.model_def, self.params, cache, inputs, self.kernels, all_prefill_logits=True)
            rows.append(np.asarray(logits[:size]))
            start += size
        for position in range(decode_from, len(ids)):
            side = self._decode_side(ids[position], position, page_table)
            logits, cache = step(self.model_def, self.params, cache, StepInputs(side, None), self.kernels)
            rows.append(np.asarray(logits))
        return np.concatenate(rows).astype(np.float32)

    def _decode_side(self, token: int, position: int, page_table) -> DecodeSide:
        return DecodeSide(
            tokens=jnp.array([token], jnp.int32), positions=jnp.array([position], jnp.int32),
            slots=jnp.zeros(1, jnp.int32), page_table=page_table,
        )  # fmt: skip

    def generate(
        self, token_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
        min_p: float = 0.0, seed: int = 0, stop_token_ids=None, ignore_eos: bool = False,
        presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
    ) -> list[int]:  # fmt: skip
        """Generate up to max_new_tokens for one prompt; stops at EOS (config) or stop_token_ids."""
        ids = self._check_ids(token_ids)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty)  # fmt: skip
        stops = set(stop_token_ids or ()) | (set() if ignore_eos else set(self.config.eos_token_ids))
        cache, page_table = self._single_cache(len(ids) + max_new_tokens)
        inputs = self._prefill_inputs(ids, 0, _round_up(len(ids), 64), page_table)
        logits, cache = step(self.model_def, self.params, cache, inputs, self.kernels)
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = sample_host(np.asarray(logits[-1]), params, step=len(out), output_ids=out, prompt_ids=ids)
            out.append(token)
            if token in stops:
                break
            side = self._decode_side(token, len(ids) + len(out) - 1, page_table)
            logits, cache = step(self.model_def, self.params, cache, StepInputs(side, None), self.kernels)
        return out


def _load_tokenizer(folder: Path):
    from qwen35_jax.tokenizer import Tokenizer

    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_dir(folder)
    log.warning("%s has no tokenizer.json: text prompts are unavailable, token ids still work", folder)
    return None


def load_params(folder: Path, cfg: Qwen35Config, dtype):
    start = time.perf_counter()
    params = load_orbax(folder, cfg, dtype) if is_orbax_folder(folder) else load_safetensors(folder, cfg, dtype)
    jax.block_until_ready(params)
    log.info("loaded weights from %s in %.2fs", folder, time.perf_counter() - start)
    return params


def load_model(path_or_preset: str | Path, dtype: str = "bfloat16", kernels: str | None = None, seed: int = 0):
    """A preset name (tiny, 0.8b, 4b, 9b, 27b: seeded random weights) or an HF / converted model folder."""
    jdtype = resolve_dtype(dtype)
    kernels = kernels or default_kernels()
    mixers(kernels)  # fail on a bad kernel set before any weight loads
    name = str(path_or_preset)
    if name.lower().removeprefix("qwen3.5-") in PRESETS and not Path(name).exists():
        cfg = preset(name)
        tokenizer = _load_tokenizer(TINY_ASSETS) if cfg.name == "tiny" else None
        return LoadedModel(cfg, random_params(cfg, jdtype, seed), jdtype, tokenizer, kernels)
    folder = Path(name)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist (and is not a preset: {', '.join(PRESETS)})")
    cfg = load_config(folder)
    return LoadedModel(cfg, load_params(folder, cfg, jdtype), jdtype, _load_tokenizer(folder), kernels)
