"""Engine construction: validated engine flags, pool sizes from a memory budget, the persistent
compilation cache, and ahead-of-time compilation of every bucket."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import jax

from qwen35_jax.cache import CacheSpec, bytes_per_page, bytes_per_slot
from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import fuse_weights, unstack_groups
from qwen35_jax.serving.engine import Engine
from qwen35_jax.serving.runner import Buckets, Runner
from qwen35_jax.serving.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

DEFAULT_COMPILE_CACHE = Path(os.environ.get("QWEN35_JAX_COMPILE_CACHE", Path.home() / ".cache" / "qwen35_jax" / "xla"))


LAYER_LOOPS = ("auto", "scan", "unstacked", "unrolled")  # unrolled: static slices of the stacked weights, A/B only


def resolve_layer_loop(layer_loop: str, platform: str | None = None) -> str:
    """ "auto": `unstacked` on a GPU, where the scan copies each layer group's weights per iteration and the
    unstacked engine decodes faster (batch 1 at 4B on the H200: 4.4 ms of device time a step against 8.3 ms) and
    is ready in 24 s from a warm cache; `scan` elsewhere, where compile time is what a small machine waits on
    (docs/performance.md)."""
    if layer_loop != "auto":
        return layer_loop
    return "unstacked" if (platform or jax.default_backend()) == "gpu" else "scan"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16
    max_prefill_tokens: int = 1024
    max_prefill_chunks: int = 1
    max_model_len: int = 8192
    page_size: int = 16
    gpu_memory_fraction: float = 0.85
    num_pages: int | None = None  # explicit KV pool size (CPU); on GPU it comes from the memory fraction
    scheduler_policy: str = "off"
    decode_overlap: str = "off"
    num_top_logprobs: int = 20
    compile_cache: str | None = str(DEFAULT_COMPILE_CACHE)
    # scan: one lax.scan over the layer groups, compile time independent of depth. unstacked: a Python loop
    # over per-group weight arrays; on the H200 at 4B it removes a copy of each group's weights per scan
    # iteration, for a longer cold compile (docs/performance.md). auto: resolve_layer_loop.
    layer_loop: str = "auto"
    # in_pool | gather (ModelDef.gdn_state): decode rows' GDN states updated in the slot pool by the kernel,
    # or gathered into a step buffer and scattered back. in_pool measured faster on the H200 (batch 256:
    # 33 ms against 55 ms a step, docs/performance.md); gather stays for A/B.
    gdn_state: str = "in_pool"
    # The MLP's gate and up weights as one [2 x intermediate, hidden] weight, one product instead of two: the MLP
    # block 15% faster at batch 1 and 34% at 256 on the H200 (tools/bench_mlp.py, docs/performance.md).
    fused_mlp: bool = True
    # The GDN layers' qkv, z, b, a weights as one, and the attention layers' q, k, v: 88 fewer products and
    # weight arrays a 4B step; on the H200 batch-1 TPOT 3.33 against 3.99 ms, batch 64 6.96 against 7.32 ms
    # (offline_bench --fused-qkv on|off, docs/performance.md, session 6).
    fused_qkv: bool = True
    # XLA compile options for every program, ((name, value), ...), e.g. (("xla_gpu_enable_triton_gemm", False),)
    # for A/B runs (offline_bench --xla-option); part of the persistent cache key. XLA rejects unknown names.
    xla_options: tuple = ()

    def __post_init__(self):
        checks = [
            (self.max_batch >= 1, f"--max-batch must be >= 1, got {self.max_batch}"),
            (self.max_prefill_tokens >= 16, f"--max-prefill-tokens must be >= 16, got {self.max_prefill_tokens}"),
            (self.max_model_len >= 2, f"--max-model-len must be >= 2, got {self.max_model_len}"),
            (self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}"),
            (0.0 < self.gpu_memory_fraction <= 1.0,
             f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}"),
            (self.num_pages is None or self.num_pages >= 2, f"--num-pages must be >= 2, got {self.num_pages}"),
            (self.scheduler_policy in ("off", "auto"), f"--scheduler-policy must be off|auto, got {self.scheduler_policy!r}"),
            (self.decode_overlap in ("off", "stream"), f"--decode-overlap must be off|stream, got {self.decode_overlap!r}"),
            (self.layer_loop in LAYER_LOOPS, f"--layer-loop must be auto|scan|unstacked, got {self.layer_loop!r}"),
            (self.gdn_state in ("gather", "in_pool"), f"--gdn-state must be gather|in_pool, got {self.gdn_state!r}"),
            (all(str(name).startswith("xla_") for name, _ in self.xla_options),
             f"--xla-option names start with xla_, got {[name for name, _ in self.xla_options]}"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.decode_overlap == "stream":
            raise ValueError(
                "--decode-overlap stream is not implemented yet (the unified step runs both sides on one "
                "stream); use --decode-overlap off"
            )


def enable_compile_cache(path: str | None) -> None:
    if not path:
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _device_free_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def cache_spec(cfg: Qwen35Config, dtype, config: EngineConfig, activation_reserve: int = 2 << 30) -> CacheSpec:
    """Slots: one per decode row plus the trash slot. Pages: explicit, or what the memory budget allows."""
    num_slots = config.max_batch + 1
    if config.num_pages is not None:
        return CacheSpec(config.num_pages, config.page_size, num_slots)
    free = _device_free_bytes()
    if free is None:  # CPU: enough for every slot to hold a full-length sequence
        pages = config.max_batch * -(-config.max_model_len // config.page_size) + 1
        return CacheSpec(pages, config.page_size, num_slots)
    budget = int(free * config.gpu_memory_fraction) - activation_reserve - num_slots * bytes_per_slot(cfg, dtype)
    pages = budget // bytes_per_page(cfg, config.page_size, dtype)
    if pages < 2:
        raise ValueError(f"no room for the KV pool: {budget} bytes left for it; lower --max-batch")
    return CacheSpec(int(pages), config.page_size, num_slots)


def use_layer_loop(model, layer_loop: str) -> None:
    """Switch a loaded model to a layer loop; "unstacked" splits the stacked group weights into one array
    per group, freeing each stacked tensor once split (the model's params are replaced)."""
    if model.model_def.layer_loop == layer_loop:
        return
    unstacked = isinstance(model.params["groups"], tuple)
    if layer_loop == "unstacked" and not unstacked:
        model.params = unstack_groups(model.params, delete_stacked=True)
    elif layer_loop != "unstacked" and unstacked:
        raise ValueError(f"layer loop {layer_loop!r} needs the stacked weights; this model's were unstacked")
    model.model_def = dataclasses.replace(model.model_def, layer_loop=layer_loop)


def use_fused_weights(model, mlp: bool, qkv: bool) -> None:
    """Switch a loaded model to fused weights as asked (its params are replaced, the unfused sources freed):
    mlp, the MLP's gate and up as one weight; qkv, the GDN and attention input projections as one each."""
    model_def = model.model_def
    for asked, fused, flag in ((mlp, model_def.fused_mlp, "--fused-mlp"), (qkv, model_def.fused_qkv, "--fused-qkv")):
        if fused and not asked:
            raise ValueError(f"this model's weights were fused; load it again for {flag} off")
    if (mlp, qkv) != (model_def.fused_mlp, model_def.fused_qkv):
        model.model_def, model.params = fuse_weights(model_def, model.params, mlp=mlp, qkv=qkv, delete_unfused=True)


def use_weights_and_states(model, config: EngineConfig) -> None:
    """Switch a loaded model to the config's fused weights and GDN-state handling (what the engine computes,
    whatever the layer loop; the GPU gate checks this form)."""
    use_fused_weights(model, config.fused_mlp, config.fused_qkv)
    model.model_def = dataclasses.replace(model.model_def, gdn_state=config.gdn_state)


def build_engine(model, config: EngineConfig, compile_now: bool = True, progress=None) -> Engine:
    """model: a qwen35_jax.api.LoadedModel (its params are fused and unstacked in place as the config asks)."""
    enable_compile_cache(config.compile_cache)
    use_weights_and_states(model, config)  # before unstacking: fusing needs stacked weights
    use_layer_loop(model, resolve_layer_loop(config.layer_loop))
    spec = cache_spec(model.config, model.dtype, config)
    log.info(
        "caches: %d KV pages of %d tokens (%.2f GiB), %d GDN slots (%.2f GiB)",
        spec.num_pages, spec.page_size, spec.num_pages * bytes_per_page(model.config, spec.page_size, model.dtype) / 2**30,
        spec.num_slots, spec.num_slots * bytes_per_slot(model.config, model.dtype) / 2**30,
    )  # fmt: skip
    buckets = Buckets.for_limits(config.max_batch, config.max_prefill_tokens, config.max_prefill_chunks)
    runner = Runner(model.model_def, model.params, model.kernels, spec, buckets, config.max_model_len,
                    config.num_top_logprobs, dict(config.xla_options))  # fmt: skip
    scheduler = Scheduler(SchedulerConfig(
        max_batch=config.max_batch, max_prefill_tokens=config.max_prefill_tokens, page_size=config.page_size,
        num_pages=spec.num_pages, num_slots=spec.num_slots, max_model_len=config.max_model_len,
        policy=config.scheduler_policy, decode_overlap=config.decode_overlap,
        max_prefill_chunks=config.max_prefill_chunks,
    ))  # fmt: skip
    if compile_now:
        seconds = runner.compile_all(progress)
        log.info("compiled %d step programs and %d row programs in %.1fs (wall; %.1fs summed over programs)",
                 runner.num_compiles, runner.num_row_compiles, seconds,
                 sum(runner.compile_seconds.values()) + sum(runner.row_compile_seconds.values()))  # fmt: skip
    return Engine(runner, scheduler, model.tokenizer, model.config.eos_token_ids)
