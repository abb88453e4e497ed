"""Engine construction: validated engine flags, pool sizes from a memory budget, the persistent
compilation cache, and ahead-of-time compilation of every bucket."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
from pathlib import Path

import jax

from qwen35_jax.cache import SSM_DTYPES, CacheSpec, bytes_per_page, bytes_per_slot
from qwen35_jax.config import Qwen35Config
from qwen35_jax.serving.engine import Engine
from qwen35_jax.serving.runner import WARM_UP_RUNS, Buckets, Runner
from qwen35_jax.serving.scheduler import OverlapBudget, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

# 8 prompts of up to 128 tokens in one step: on the H200 at 4B, (0, 8, 128) takes 24.1 ms, as one 1024-token
# chunk does (23.8 ms), against 6.7 ms for each 128-token prompt alone (docs/performance.md). The packed programs
# add 9 step programs to the defaults' 37.
DEFAULT_PREFILL_CHUNKS = 8
# Prompt logprobs are on by default, as vLLM serves them without a flag and evaluation harnesses ask for them
# (echo with logprobs): 64 is three programs (chunks 16, 32, 64) in the set built before serving, and a 4B chunk of
# 64 took 7.1 ms against 5.0 ms for the plain prefill step (docs/performance.md, run L).
DEFAULT_PROMPT_LOGPROBS_CHUNK = 64
DEFAULT_COMPILE_CACHE = Path(os.environ.get("QWEN35_JAX_COMPILE_CACHE", Path.home() / ".cache" / "qwen35_jax" / "xla"))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16
    max_prefill_tokens: int = 1024
    # Prompts one step may carry: short prompts that arrive together prefill together, within one full chunk of
    # padded tokens (`plan.packed_chunk_cap`); beside decode rows, prompts of up to max_prefill_tokens /
    # max_prefill_chunks tokens (one chunk under `--decode-overlap stream`). None: DEFAULT_PREFILL_CHUNKS, or 1
    # under `deterministic`.
    max_prefill_chunks: int | None = None
    max_model_len: int = 8192
    page_size: int = 16
    gpu_memory_fraction: float = 0.85
    num_pages: int | None = None  # explicit KV pool size (CPU); on GPU it comes from the memory fraction
    # The GDN recurrent states' storage (`cache.SSM_DTYPES`; vLLM's flag name). "auto" is float32, the precision
    # HF keeps them in; bfloat16 halves their traffic, which a decode step spends per row.
    mamba_ssm_cache_dtype: str = "float32"
    scheduler_policy: str = "off"
    decode_overlap: str = "off"
    # Under stream overlap, a step that carries a prompt chunk beside decode rows costs at most this many times
    # the decode-only step (measured per bucket at start). At 3.0 a 4B server on the H200 takes 128-token chunks
    # beside its decoders, which cuts the mixed-load ITL p99 of `off` by more than half (docs/overlap.md).
    overlap_step_bound: float = 3.0
    num_top_logprobs: int = 20
    # The largest chunk of a prompt-logprobs step (echo with logprobs, prompt_logprobs), whose programs make the
    # logits of every chunk position ([T, vocab] fp32 scratch: 254 MB at T = 256 and the 4B vocabulary); 0 builds
    # none, and such requests get a 400. None: DEFAULT_PROMPT_LOGPROBS_CHUNK, or max_prefill_tokens if smaller.
    prompt_logprobs_chunk: int | None = None
    # Every request's tokens and logprobs independent of what shares its steps (`Buckets.for_limits`,
    # `SchedulerConfig.batch_invariant`): decode always runs the `max_batch` program, and prompt chunks run in
    # steps of their own.
    deterministic: bool = False
    compile_cache: str | None = str(DEFAULT_COMPILE_CACHE)
    # Serve once `Buckets.ready_keys` are built, padding each step up to a built program, and build the rest in a
    # background thread. None: on, except under `deterministic` (its buckets are its chunk boundaries) and
    # `decode_overlap` stream (its budget is measured over the whole set), which build everything first.
    background_compile: bool | None = False
    # Keep compiled programs in `compile_cache`/programs, so a warm start loads them without lowering
    # (`serving/program_store.py`). None: on a GPU only. On a CPU, some XLA:CPU programs saved by one process
    # crashed (SIGSEGV) when another process loaded and ran them, so there they are compiled from XLA's cache.
    program_store: bool | None = None

    def __post_init__(self):
        if self.max_prefill_chunks is None:
            object.__setattr__(self, "max_prefill_chunks", 1 if self.deterministic else DEFAULT_PREFILL_CHUNKS)
        if self.prompt_logprobs_chunk is None:
            chunk = min(DEFAULT_PROMPT_LOGPROBS_CHUNK, self.max_prefill_tokens)
            object.__setattr__(self, "prompt_logprobs_chunk", chunk)
        if self.mamba_ssm_cache_dtype == "auto":
            object.__setattr__(self, "mamba_ssm_cache_dtype", "float32")
        whole_set_first = self.deterministic or self.decode_overlap == "stream"
        if self.background_compile and whole_set_first:
            raise ValueError(
                "--background-compile cannot be combined with --deterministic or --decode-overlap stream: both "
                "build every program before serving"
            )
        if self.background_compile is None:
            object.__setattr__(self, "background_compile", not whole_set_first)
        checks = [
            (self.max_batch >= 1, f"--max-batch must be >= 1, got {self.max_batch}"),
            (self.max_prefill_tokens >= 16, f"--max-prefill-tokens must be >= 16, got {self.max_prefill_tokens}"),
            (isinstance(self.max_prefill_chunks, int) and not isinstance(self.max_prefill_chunks, bool)
             and self.max_prefill_chunks >= 1,
             f"--max-prefill-chunks must be an integer >= 1, got {self.max_prefill_chunks!r}"),
            (self.max_model_len >= 2, f"--max-model-len must be >= 2, got {self.max_model_len}"),
            (self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}"),
            (0.0 < self.gpu_memory_fraction <= 1.0,
             f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}"),
            (self.num_pages is None or self.num_pages >= 2, f"--num-pages must be >= 2, got {self.num_pages}"),
            (self.mamba_ssm_cache_dtype in SSM_DTYPES,
             f"--mamba-ssm-cache-dtype must be auto|{'|'.join(SSM_DTYPES)}, got {self.mamba_ssm_cache_dtype!r}"),
            (self.scheduler_policy in ("off", "auto"), f"--scheduler-policy must be off|auto, got {self.scheduler_policy!r}"),
            (self.decode_overlap in ("off", "stream"), f"--decode-overlap must be off|stream, got {self.decode_overlap!r}"),
            (isinstance(self.overlap_step_bound, (int, float)) and not isinstance(self.overlap_step_bound, bool)
             and self.overlap_step_bound >= 1.0,
             f"--overlap-step-bound must be a number >= 1.0, got {self.overlap_step_bound!r}"),
            (isinstance(self.prompt_logprobs_chunk, int) and not isinstance(self.prompt_logprobs_chunk, bool)
             and 0 <= self.prompt_logprobs_chunk <= self.max_prefill_tokens,
             f"--prompt-logprobs-chunk must be an integer in [0, --max-prefill-tokens = {self.max_prefill_tokens}], "
             f"got {self.prompt_logprobs_chunk!r}"),
            (not (self.deterministic and self.decode_overlap == "stream"),
             "--deterministic cannot be combined with --decode-overlap stream: deterministic steps never run a prompt "
             "chunk beside decode rows, so there is nothing to overlap"),
            (not self.deterministic or self.max_prefill_chunks == 1,
             f"--deterministic steps carry one prompt chunk, so --max-prefill-chunks must be 1 with it, got "
             f"{self.max_prefill_chunks}"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


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
    num_slots, ssm_dtype = config.max_batch + 1, config.mamba_ssm_cache_dtype
    if config.num_pages is not None:
        return CacheSpec(config.num_pages, config.page_size, num_slots, ssm_dtype)
    free = _device_free_bytes()
    if free is None:  # CPU: enough for every slot to hold a full-length sequence
        pages = config.max_batch * -(-config.max_model_len // config.page_size) + 1
        return CacheSpec(pages, config.page_size, num_slots, ssm_dtype)
    slots = num_slots * bytes_per_slot(cfg, dtype, ssm_dtype)
    budget = int(free * config.gpu_memory_fraction) - activation_reserve - slots
    pages = budget // bytes_per_page(cfg, config.page_size, dtype)
    if pages < 2:
        raise ValueError(f"no room for the KV pool: {budget} bytes left for it; lower --max-batch")
    return CacheSpec(int(pages), config.page_size, num_slots, ssm_dtype)


def build_engine(model, config: EngineConfig, compile_now: bool = True, progress=None) -> Engine:
    """model: a qwen35_jax.api.LoadedModel; the engine runs its params and kernel set as they are."""
    enable_compile_cache(config.compile_cache)
    spec = cache_spec(model.config, model.dtype, config)
    log.info(
        "caches: %d KV pages of %d tokens (%.2f GiB), %d GDN slots (%.2f GiB, states in %s)",
        spec.num_pages, spec.page_size, spec.num_pages * bytes_per_page(model.config, spec.page_size, model.dtype) / 2**30,
        spec.num_slots, spec.num_slots * bytes_per_slot(model.config, model.dtype, spec.ssm_dtype) / 2**30,
        spec.ssm_dtype,
    )  # fmt: skip
    scheduler_config = SchedulerConfig(
        max_batch=config.max_batch, max_prefill_tokens=config.max_prefill_tokens, page_size=config.page_size,
        num_pages=spec.num_pages, num_slots=spec.num_slots, max_model_len=config.max_model_len,
        policy=config.scheduler_policy, decode_overlap=config.decode_overlap,
        max_prefill_chunks=config.max_prefill_chunks, prompt_logprobs_chunk=config.prompt_logprobs_chunk,
        batch_invariant=config.deterministic,
    )  # fmt: skip
    # The packed unified programs exist exactly when the scheduler packs several chunks beside decode rows.
    buckets = Buckets.for_limits(config.max_batch, config.max_prefill_tokens, config.max_prefill_chunks,
                                 config.prompt_logprobs_chunk, batch_invariant=config.deterministic,
                                 pack_beside_decode=scheduler_config.chunks_beside_decode > 1)  # fmt: skip
    on_gpu = jax.default_backend() == "gpu"
    use_store = on_gpu if config.program_store is None else config.program_store
    store = str(Path(config.compile_cache) / "programs") if config.compile_cache and use_store else None
    runner = Runner(model.model_def, model.params, model.kernels, spec, buckets, config.max_model_len,
                    config.num_top_logprobs, decode_overlap=config.decode_overlap, program_store=store)  # fmt: skip
    scheduler = Scheduler(scheduler_config)
    if compile_now:
        start = time.perf_counter()
        if config.decode_overlap == "stream":
            scheduler.overlap_budget = compile_overlapped(runner, config.overlap_step_bound, progress)
        elif config.background_compile:
            runner.compile_ready_set(progress)
        else:
            runner.compile_all(progress)
        summed = sum(runner.compile_seconds.values()) + sum(runner.row_compile_seconds.values())
        summed += sum(runner.prompt_compile_seconds.values())
        if on_gpu:
            log.info("warmed every step program up (%d runs each) in %.1fs", WARM_UP_RUNS, runner.warm_up())
        loaded = f"; {runner.store.loaded} loaded from {runner.store.path}" if runner.store else ""
        log.info("built %d step programs, %d row programs and %d prompt-logprobs programs in %.1fs (wall; %.1fs "
                 "summed over programs%s)", runner.num_compiles, runner.num_row_compiles, runner.num_prompt_compiles,
                 time.perf_counter() - start, summed, loaded)  # fmt: skip
        if config.background_compile:
            missing = runner.programs_total() - runner.programs_built()
            if missing:
                log.info("building the other %d programs in the background; until then steps pad up", missing)
                runner.compile_in_background(workers=max(1, (os.cpu_count() or 1) // 4))
    engine = Engine(runner, scheduler, model.tokenizer, model.config.eos_token_ids)
    engine.warm_up_idle = on_gpu
    return engine


def compile_overlapped(runner: Runner, bound: float, progress=None) -> OverlapBudget:
    """Under stream, a step with decode rows carries at most the budget's chunk, so the unified programs past it
    are never run, and they are the most numerous programs. So
    the decode-only and prefill-only programs are compiled first (with the row and prompt-logprobs programs);
    then the unified programs one chunk bucket at a time, from the smallest, each wave measured, and a decode
    bucket stops at its first chunk past the bound. Returns the budget sized from the measured costs; logs it."""
    buckets = runner.buckets
    runner.compile_all(progress, keys=[key for key in buckets.keys() if not (key[0] and key[1])])
    costs = runner.measure_step_costs([(b, 0, 0) for b in buckets.unified_decode])
    open_rows = list(buckets.unified_decode)
    for chunk in buckets.unified_chunk:
        wave = [key for key in buckets.unified_keys((chunk,)) if key[0] in open_rows]
        runner.compile_all(keys=wave)
        costs.update(runner.measure_step_costs(wave))
        open_rows = [b for b in open_rows if costs[(b, 1, chunk)] <= bound * costs[(b, 0, 0)]]
        if not open_rows:
            break
    log.info("step costs (ms): %s", ", ".join(f"{key}: {cost * 1e3:.2f}" for key, cost in sorted(costs.items())))
    budget = OverlapBudget.from_costs(costs, bound)
    log.info("overlapped steps within %.2fx of decode: %s", bound,
             ", ".join(f"B<={rows}: {tokens} prompt tokens" for rows, tokens in budget.limits))  # fmt: skip
    return budget


def freeze_startup_heap(runner: Runner) -> threading.Thread | None:
    """Takes every object alive now out of the garbage collector's scans (`gc.freeze`), and does so again once the
    background build is done (the thread that waits for it is returned; None when nothing builds).

    Why: a built engine holds ~0.9 million objects that live as long as the process (programs, pytrees, the
    tokenizer). Python's full collections walk all of them: 0.51-0.62 s a pass for the tiny preset on the 2-core
    CPU, during which the engine thread and the event loop both stop. A frozen heap leaves a pass only the objects
    made since (docs/architecture.md, section 1). Only the young generations are collected first: a full pass at
    that point found nothing to reclaim, as the collections during start-up already ran, and would add its own
    half second to the time to ready."""

    def freeze(what: str) -> None:
        gc.collect(1)
        gc.freeze()
        log.info("%s: %d objects out of the garbage collector's scans", what, gc.get_freeze_count())

    freeze("froze the start-up heap")
    if not runner.building:
        return None

    def after_background() -> None:
        runner.wait_for_background()
        freeze("froze the heap again after the background build")

    waiter = threading.Thread(target=after_background, name="freeze-after-build", daemon=True)
    waiter.start()
    return waiter
