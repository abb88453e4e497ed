"""The runner: turns a StepPlan into padded bucket inputs and launches the compiled step, without waiting.

One compiled program per bucket key (decode rows B, prefill rows P, chunk tokens T); B = 0 or P = 0 drops
that side, so decode-only, prefill-only and unified steps come from the same model code. Every program is
built before its first step (`compile_all`; or `compile_ready_set`, whose programs every step can pad up to, then
`compile_in_background` for the rest), and each build is logged and counted, so a test can assert that serving
compiled nothing new.

Sampled tokens stay on the device: the step writes each row's token into `token_state[slot]`, and the
next step's decode rows read their input token from there. The host reads the step's outputs one step
late (`StepHandle.fetch`), after it has launched the next step.

A step program picks each row's greedy token and its logprob. Two small "row programs" per output row
count (B + P) follow it when the host, from the requests, knows they are needed: the sampler, when a row
samples (temperature > 0), is penalised, has a logit_bias or a grammar's token mask, picks those rows'
tokens from the step's logits and overwrites them in `token_state`; the top-logprobs program, when a row
asks for top logprobs, runs the full-vocabulary top-k (a sort in XLA) that other steps skip. A third,
`mark_prompt` (one program), records the prompt tokens of requests with a repetition penalty before the
sampler reads them. Nothing in any program depends on a device value the host must read: a `lax.cond` on
"does any row sample" made XLA's GPU runtime wait for the device inside every launch.

A prompt-logprobs step (`StepPlan.prompt_logprobs`: one chunk, no decode rows) runs its own program, one per chunk
bucket up to `--prompt-logprobs-chunk` (none by default): the prefill step that also scores every prompt token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.batch import DecodeSide, InputLayout, PrefillSide, StepInputs
from qwen35_jax.cache import CacheSpec, new_cache
from qwen35_jax.kernels import Mixers, chunk_attention
from qwen35_jax.model import ModelDef, forward
from qwen35_jax.sampling import MAX_LOGIT_BIAS
from qwen35_jax.serving.device_sampling import (
    SamplingRows,
    greedy,
    mask_words,
    prompt_token_logprobs,
    resample,
    top_logprobs,
)
from qwen35_jax.serving.plan import (
    PACKED_MIN_CHUNK,
    StepPlan,
    bucket_for,
    chunk_buckets,
    packed_unified_chunk_buckets,
    power_of_two_buckets,
)
from qwen35_jax.serving.pools import TRASH_PAGE
from qwen35_jax.serving.program_store import ProgramStore, compile_noting_cache

log = logging.getLogger(__name__)

MAX_COMPILE_WORKERS = 8  # XLA compiles in parallel threads; more than 8 mostly adds host memory
# On a GPU, the step programs with decode rows and at least two logit rows take cuBLAS's GEMMs, picked by its
# heuristic, where XLA would autotune among cuBLAS and Triton GEMMs. The autotuner's pick varied between compiles
# (batch 64 at 6.1 or 7.3 ms when it kept a split-K Triton GEMM for the GDN in_proj) and between the separately
# compiled programs of `--decode-overlap stream` and `off`, whose greedy tokens then differed (with the pin they
# agree over 64 requests at 4B). On the H200 at 4B the pinned programs were faster or level (docs/performance.md,
# run Q): batch 256 6.16-6.25 against 6.49-6.60 ms, the unified (16, 1, 256) 8.25-8.36 against 9.14-9.26, batches
# 16-64 within 1%; the unified (64, 1, 256) 3% slower. Batch 1 keeps the autotuner: its one-row logits product went
# through an fp32 copy of the lm_head (2.4 GiB of scratch, 4.41 against 3.16 ms). So do prefill-only programs,
# where it won (0, 1, 256: 7.91-7.95 against 8.77-9.19 ms).
PINNED_GEMMS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
# `--decode-overlap stream` on a GPU: the unified programs' command buffer (the CUDA graph in which XLA runs a
# program's kernels) is built concurrent, each kernel waiting only for the kernels whose buffers it reads or
# overwrites, so the graph's independent branches run on separate streams: the decode side's mixers beside the
# prefill side's, whose inputs and outputs are disjoint. XLA's default serialises the graph in program order. On the
# H200 at 4B the unified (16, 1, 256) took 7.66 ms concurrent against 8.26 ms serialised, and its two sides run as
# separate programs 11.7 ms (docs/overlap.md). Annotating each side's mixers as a stream region
# (`jax.experimental.compute_on`) ran them at once only with command buffers off or concurrent, and was slower in
# every setting (9.25-12.3 ms): every region breaks the program's command buffer, and the decode side's slot
# states had to be gathered into the region and scattered back.
CONCURRENT_GRAPH = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
# On a GPU, prefill-only step programs launch their kernels one by one instead of as a command buffer. In a command
# buffer, most calls of such a program took ~7 ms longer than the best one: on the H200 at 4B, one prompt at a time,
# the median of three TTFTs against the best was 28.0 / 20.5 ms at 1024 tokens and 141.9 / 134.3 ms at 8192, and
# 11 of 13 earlier runs showed the same gap. Without it: 20.9 / 20.6 ms and 135.7 / 134.3 ms. Their ~550 kernels
# take ~30 us each on average, so the host launching them one at a time stays ahead of the GPU. Decode steps keep
# their command buffers: their kernels are short and the launch is the host's largest cost (batch 1: 3.12 against
# 2.89 ms without).
PREFILL_WITHOUT_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
# On a GPU, no step program goes through XLA's rematerialization pass. The pass budgets a program against the device
# memory less its parameters and outputs, and a step's are the weights and the caches, which fill most of the
# device: with the engine's default memory fraction the 4B programs count as ~124 GB against a ~51 GB limit, so the
# pass rewrites them for memory they never run short of (the caches are donated and updated in place) and still
# warns that it cannot reach its limit. On an H100 at 4B, one 1024-token prompt at a time, the prefill took 18.29 ms
# without the pass against 20.32 ms with it (the mean of the best of three, five runs each, alternating on one
# machine); the 8192-token prefill and batch-1 decode were the same with and without (docs/performance.md).
NO_REMATERIALIZATION = {"xla_disable_hlo_passes": "rematerialization"}
# XLA runs a program with command buffers op by op the first time, and records and instantiates its CUDA graph (a
# few hundred kernel nodes) on the second run: `warm_up` makes both runs, so neither lands in a request's step.
WARM_UP_RUNS = 2


def gpu_step_options(key) -> dict:
    """XLA options of the step program `key` (B, P, T) for a GPU: NO_REMATERIALIZATION, with PINNED_GEMMS where it
    has decode rows and two logit rows or more, PREFILL_WITHOUT_GRAPHS where it has no decode rows."""
    decode_rows, prefill_rows, _ = key
    if not decode_rows:
        return NO_REMATERIALIZATION | PREFILL_WITHOUT_GRAPHS
    return NO_REMATERIALIZATION | (PINNED_GEMMS if decode_rows + prefill_rows >= 2 else {})


# The smallest chunk bucket beside decode rows. Up to a few hundred rows, the dense layers read every weight
# once whatever the row count (they are memory-bound), and the GDN prefill works in 64-token chunks, so a
# shorter chunk padded to 64 costs the same step time and each decode bucket needs fewer unified programs.
UNIFIED_MIN_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode: tuple[int, ...]  # decode rows per step
    prefill_rows: tuple[int, ...]  # prefill chunks per step
    chunk: tuple[int, ...]  # tokens per prefill chunk
    prompt_logprobs_chunk: tuple[int, ...] = ()  # tokens per chunk of a prompt-logprobs step (none: no such step)
    # False: no step carries both sides, so there are no unified programs (`--deterministic`).
    unified: bool = True
    # Tokens per chunk of the unified programs with several chunks (`packed_unified_keys`); none: a step with
    # decode rows carries one chunk.
    packed_unified_chunk: tuple[int, ...] = ()

    @classmethod
    def for_limits(cls, max_batch: int, max_prefill_tokens: int, max_prefill_chunks: int,
                   prompt_logprobs_chunk: int = 0, batch_invariant: bool = False,
                   pack_beside_decode: bool = True) -> Buckets:  # fmt: skip
        """batch_invariant: every decode step runs the `max_batch` program, whatever its row count, and no step
        packs decode rows beside a chunk. A product's rounding depends on its row count, never on the other
        rows' values or on where a row sits, so a request's tokens then do not depend on what shares its step.
        pack_beside_decode: steps with decode rows may carry several short chunks
        (`SchedulerConfig.chunks_beside_decode`)."""
        scored = power_of_two_buckets(prompt_logprobs_chunk, smallest=min(16, prompt_logprobs_chunk))
        packs = pack_beside_decode and not batch_invariant
        return cls(
            decode=(max_batch,) if batch_invariant else power_of_two_buckets(max_batch),
            prefill_rows=power_of_two_buckets(max_prefill_chunks),
            chunk=chunk_buckets(max_prefill_tokens),
            prompt_logprobs_chunk=scored if prompt_logprobs_chunk else (),
            unified=not batch_invariant,
            packed_unified_chunk=packed_unified_chunk_buckets(max_prefill_tokens, max_prefill_chunks) if packs else (),
        )

    @property
    def unified_decode(self) -> tuple[int, ...]:
        """Decode buckets of the unified programs: those from a quarter of the largest. Beside a chunk of 64 tokens
        or more, padding decode rows costs little (the products are over T + B rows, and padding rows skip the
        GDN step and read one KV page), and the unified programs are the most numerous and the slowest to
        build."""
        if not self.unified:
            return ()
        return tuple(b for b in self.decode if 4 * b >= self.decode[-1])

    @property
    def unified_chunk(self) -> tuple[int, ...]:
        """Chunk buckets of the unified programs: those from UNIFIED_MIN_CHUNK (or the largest, if smaller)."""
        if not self.unified:
            return ()
        return tuple(t for t in self.chunk if t >= min(UNIFIED_MIN_CHUNK, self.chunk[-1]))

    def row_programs(self) -> list[tuple[str, int]]:
        """(kind, rows) of every row program: a sampler and a top-logprobs program per output row count B + P, the
        prompt-token marker over the most prompt tokens a step carries, and the prompt-prefix copy."""
        return self.rows_of(self.keys())

    def keys(self) -> list[tuple[int, int, int]]:
        """Every (B, P, T) program: decode-only, prefill-only and unified. Programs pack several chunks only where
        their padded tokens stay within one full chunk (`plan.packed_chunk_cap`)."""
        decode = [(b, 0, 0) for b in self.decode]
        prefill = [(0, 1, t) for t in self.chunk]
        prefill += [(0, p, t) for p in self.prefill_rows[1:] for t in self.packed_chunk if p * t <= self.chunk[-1]]
        return decode + prefill + self.unified_keys() + self.packed_unified_keys()

    def packed_unified_keys(self) -> list[tuple[int, int, int]]:
        """Several short chunks beside decode rows: prompts that arrive while others decode prefill together.
        Only at the largest decode bucket: beside P x T prompt tokens, padding decode rows costs little (see
        `unified_decode`), and the largest of them, (B, max chunks, longest T), holds every such step."""
        b = self.unified_decode[-1] if self.unified_decode else 0
        return [(b, p, t) for p in self.prefill_rows[1:] for t in self.packed_unified_chunk] if b else []

    def ready_keys(self) -> list[tuple[int, int, int]]:
        """The fewest programs that can run every plan, each padded up to one of them: the largest decode-only,
        prefill-only and unified buckets, and for each count of packed chunks the longest chunk it allows (a
        plan's chunk count and length pick its program, `key_for`, so no other packed program covers it)."""
        keys = [(self.decode[-1], 0, 0), (0, 1, self.chunk[-1])]
        for p in self.prefill_rows[1:]:
            fits = [t for t in self.packed_chunk if p * t <= self.chunk[-1]]
            if fits:
                keys.append((0, p, fits[-1]))
        unified, packed = self.unified_keys(), self.packed_unified_keys()
        return keys + ([max(unified)] if unified else []) + ([max(packed)] if packed else [])

    def rows_of(self, keys) -> list[tuple[str, int]]:
        """The row programs the steps of `keys` use, with the prompt-token marker and the prefix copy."""
        rows = sorted({b + p for b, p, _ in keys})
        return [(kind, r) for kind in ROW_PROGRAMS for r in rows] + [(MARK_PROMPT, self.chunk[-1]), (COPY_PREFIX, 1)]

    @property
    def packed_chunk(self) -> tuple[int, ...]:
        """Chunk buckets of the prefill-only programs with several chunks (`plan.packed_chunk_buckets`)."""
        return tuple(t for t in self.chunk if t >= min(PACKED_MIN_CHUNK, self.chunk[-1]))

    def _packed_unified_key(self, plan: StepPlan, longest: int) -> tuple[int, int, int]:
        chunks = self.packed_unified_chunk
        if not chunks or len(plan.prefill) > self.prefill_rows[-1] or longest > chunks[-1]:
            raise ValueError(
                f"step {plan.step_id} packs decode rows beside {len(plan.prefill)} prompt chunks of up to {longest} "
                f"tokens, which these buckets never do (beside decode rows: chunks of up to "
                f"{chunks[-1] if chunks else 0} tokens, at most {self.prefill_rows[-1] if chunks else 1} of them)"
            )
        return self.unified_decode[-1], bucket_for(len(plan.prefill), self.prefill_rows), bucket_for(longest, chunks)

    def unified_keys(self, chunks: tuple[int, ...] | None = None) -> list[tuple[int, int, int]]:
        """The unified programs, at the given chunk buckets (all of them by default)."""
        chunks = self.unified_chunk if chunks is None else chunks
        return [(b, 1, t) for b in self.unified_decode for t in chunks]

    def key_for(self, plan: StepPlan) -> tuple[int, int, int]:
        """(B, P, T) of the plan's program; a prompt-logprobs step's is (0, 1, T) in `prompt_logprobs_chunk`."""
        if plan.prompt_logprobs:
            return 0, 1, bucket_for(len(plan.prefill[0].token_ids), self.prompt_logprobs_chunk)
        if not plan.prefill:
            return bucket_for(plan.num_decode_rows, self.decode) if plan.decode else 0, 0, 0
        b = bucket_for(plan.num_decode_rows, self.unified_decode or self.decode) if plan.decode else 0
        longest = max(len(c.token_ids) for c in plan.prefill)
        if b and len(plan.prefill) > 1:
            return self._packed_unified_key(plan, longest)
        if b and not self.unified:
            raise ValueError(
                f"step {plan.step_id} packs decode rows beside a prompt chunk, which these buckets never do"
            )
        rows = bucket_for(len(plan.prefill), self.prefill_rows)
        key = b, rows, bucket_for(longest, self.unified_chunk if b else self.packed_chunk if rows > 1 else self.chunk)
        if not b and key[1] > 1 and key[1] * key[2] > self.chunk[-1]:
            raise ValueError(f"step {plan.step_id} packs {len(plan.prefill)} chunks of up to {longest} tokens: "
                             f"{key[1]} x {key[2]} padded tokens exceed the largest chunk, {self.chunk[-1]}")  # fmt: skip
        return key


ROW_PROGRAMS = ("sample", "top")  # one of each per output row count
MARK_PROMPT = "mark_prompt"  # one program: its shapes are the step's largest prefill (tokens and chunks)
COPY_PREFIX = "copy_prefix"  # one program: a prompt prefix's caches from one request to another (StateCopy)


def _step_on_leaves(treedef, model: ModelDef, mixer_set: Mixers, param_leaves, cache, token_state, packed,
                    layout: InputLayout):  # fmt: skip
    """The step program: its inputs come packed in one int32 array (`InputLayout`), its layout a static argument."""
    params = jax.tree.unflatten(treedef, param_leaves)
    return engine_step(model, mixer_set, params, cache, token_state, layout.unpack(packed))


def _prompt_step_on_leaves(treedef, model: ModelDef, mixer_set: Mixers, num_top: int, param_leaves, cache,
                           token_state, packed, targets, layout: InputLayout):  # fmt: skip
    params = jax.tree.unflatten(treedef, param_leaves)
    return prompt_logprobs_step(model, mixer_set, num_top, params, cache, token_state, layout.unpack(packed), targets)


def prompt_logprobs_step(model: ModelDef, mixer_set: Mixers, num_top: int, params, cache, token_state, inputs,
                         targets):  # fmt: skip
    """engine_step for one prefill chunk (P = 1, no decode rows) that also scores the prompt: the logits of every
    position are made, and each position returns the logprob and rank of the next prompt token (`targets` [T])
    and the top `num_top` logprobs. Only [T] and [T, num_top] arrays leave the program, never the [T, vocab]
    logits. Returns engine_step's four outputs, then (logprobs, ranks, top ids, top logprobs)."""
    logits, cache = forward(model, params, cache, inputs, mixer_set, all_prefill_logits=True)  # [T, vocab]
    last = logits[inputs.prefill.last_index]  # [1, vocab]: the first output token's, if this is the last chunk
    tokens, chosen = greedy(last)
    token_state = token_state.at[inputs.prefill.slots].set(tokens)
    return cache, token_state, (tokens, chosen), last, prompt_token_logprobs(logits, targets, num_top)


def engine_step(model: ModelDef, mixer_set: Mixers, params, cache, token_state, inputs):
    """forward + greedy tokens; decode tokens come from token_state (the inputs' are None), the chosen tokens go
    back into it.
    Returns (cache, token_state, (tokens, their logprobs), logits for the row programs)."""
    slots = []
    if inputs.decode is not None:
        inputs = dataclasses.replace(
            inputs, decode=dataclasses.replace(inputs.decode, tokens=token_state[inputs.decode.slots])
        )
        slots.append(inputs.decode.slots)
    if inputs.prefill is not None:
        slots.append(inputs.prefill.slots)
    logits, cache = forward(model, params, cache, inputs, mixer_set)
    tokens, chosen = greedy(logits)
    token_state = token_state.at[jnp.concatenate(slots)].set(tokens)
    return cache, token_state, (tokens, chosen), logits


def sampler_step(logits, rows: SamplingRows, token_state, output_counts, prompt_mask, slots, tokens):
    """The draw for the sampled rows of a step (greedy rows keep `tokens`, unless penalties, a logit_bias or a
    grammar's mask move their argmax); the tokens go into token_state at `slots` (the step's rows, padding rows at the trash slot),
    and into each row's output-token counts, which the penalties read beside the slot's prompt tokens
    (`prompt_mask`, read only). A request's first output token (output_index 0) starts its slot's counts from
    zero; a chunk that samples nothing (output_index -1) leaves them.
    -> (token_state, output_counts, tokens, logprobs)"""
    counts = output_counts[slots] * (rows.output_index[:, None] > 0)
    tokens, chosen = resample(logits, rows, tokens, counts, prompt_mask[slots])
    counts = counts.at[jnp.arange(tokens.shape[0]), tokens].add(1)
    counts = jnp.where(rows.output_index[:, None] >= 0, counts, output_counts[slots])
    return token_state.at[slots].set(tokens), output_counts.at[slots].set(counts), tokens, chosen


def mark_prompt_tokens(prompt_mask, fresh_slots, token_slots, token_ids):
    """prompt_mask [slots, V] bool, which tokens each slot's prompt holds (for the repetition penalty): the rows
    of `fresh_slots` (chunks that start a prompt; padding: the trash slot) are cleared, then each prompt token
    `token_ids[i]` is set in row `token_slots[i]` (padding: token 0 of the trash slot)."""
    prompt_mask = prompt_mask.at[fresh_slots].set(False)
    return prompt_mask.at[token_slots, token_ids].set(True)


def copy_prefix(cache, prompt_mask, src_slot, dst_slot, src_pages, dst_pages):
    """`StateCopy`: slot dst_slot's GDN states and prompt tokens become src_slot's, and each page dst_pages[i] of
    every attention layer gets page src_pages[i]'s K/V. The page lists are the page table's width, padded with the
    trash page (copied onto itself: garbage to garbage)."""
    return dataclasses.replace(
        cache,
        k_pages=cache.k_pages.at[:, dst_pages].set(cache.k_pages[:, src_pages]),
        v_pages=cache.v_pages.at[:, dst_pages].set(cache.v_pages[:, src_pages]),
        ssm=cache.ssm.at[:, dst_slot].set(cache.ssm[:, src_slot]),
        conv=cache.conv.at[:, dst_slot].set(cache.conv[:, src_slot]),
    ), prompt_mask.at[dst_slot].set(prompt_mask[src_slot])


@dataclasses.dataclass
class StepHandle:
    """A launched step: its plan and its device outputs, read by the host one step later."""

    plan: StepPlan
    key: tuple[int, int, int]  # the bucket (B, P, T): prefill rows' outputs start at index B
    outputs: tuple
    launched_at: float
    # A prompt-logprobs step's (logprobs [T], ranks [T], top ids [T, N], top logprobs [T, N]); () for other steps.
    prompt_outputs: tuple = ()

    def output_rows(self):
        """(output row index, plan row) for every decode row and prefill chunk of the plan."""
        yield from enumerate(self.plan.decode)
        yield from ((self.key[0] + j, chunk) for j, chunk in enumerate(self.plan.prefill))

    def fetch(self) -> tuple[np.ndarray | None, ...]:
        """Blocks until the step is done; (tokens [R], logprob [R], top ids [R, N], top logprobs [R, N]), the
        logprob None when no row of the step asked for logprobs, the top ones when none asked for top logprobs."""
        return tuple(None if x is None else np.asarray(x) for x in self.outputs)

    def fetch_prompt_logprobs(self) -> tuple[np.ndarray, ...]:
        """Blocks until the step is done; `prompt_outputs` on the host."""
        return tuple(np.asarray(x) for x in self.prompt_outputs)


def overlaps_sides(decode_overlap: str, platform: str | None = None) -> bool:
    """True when the unified programs run the two sides' mixers at once (CONCURRENT_GRAPH): `stream` on a GPU.
    Elsewhere `stream` compiles `off`'s programs (XLA:CPU has no command buffers), so its scheduling is tested
    anywhere."""
    return decode_overlap == "stream" and (platform or jax.default_backend()) == "gpu"


class Runner:
    def __init__(self, model_def: ModelDef, params, mixer_set: Mixers, spec: CacheSpec, buckets: Buckets,
                 max_model_len: int, num_top_logprobs: int = 20, decode_overlap: str = "off",
                 program_store: str | None = None):  # fmt: skip
        self.overlaps = overlaps_sides(decode_overlap)
        self.model_def, self.params, self.mixers = model_def, params, mixer_set
        self.spec, self.buckets = spec, buckets
        self.page_table_width = -(-max_model_len // spec.page_size)
        self._page_arrays: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}  # request id -> its pages, both ways
        self.num_top = num_top_logprobs
        self.trash_slot = spec.num_slots - 1
        self.cache = new_cache(model_def.cfg, spec, model_def.dtype)
        self.token_state = jnp.zeros(spec.num_slots, jnp.int32)
        # Each slot's output-token counts, for the penalties (kept by the sampler program), and which tokens its
        # prompt holds, for the repetition penalty (set by the mark_prompt program from the chunks of the requests
        # that have one; other slots' rows are stale, and neutral to a penalty of 1).
        self.output_counts = jnp.zeros((spec.num_slots, model_def.cfg.vocab_size), jnp.int32)
        self.prompt_mask = jnp.zeros((spec.num_slots, model_def.cfg.vocab_size), jnp.bool_)
        self.mask_words = mask_words(model_def.cfg.vocab_size)
        # All-allowed token masks on the device, by row count: sampler steps without a grammar row send none.
        self._no_masks: dict[int, jax.Array] = {}
        self.executables: dict[tuple[int, int, int], object] = {}
        self.compile_seconds: dict[tuple[int, int, int], float] = {}
        self.temp_bytes: dict[tuple[int, int, int], int] = {}  # device scratch of each program
        self.row_executables: dict[tuple[str, int], object] = {}  # by `Buckets.row_programs` key
        self.row_compile_seconds: dict[tuple[str, int], float] = {}
        self.prompt_executables: dict[int, object] = {}  # prompt-logprobs step programs, by chunk bucket T
        self.prompt_compile_seconds: dict[int, float] = {}
        # The programs take the weights as a flat list: flattening the nnx tree runs Python per variable, which
        # at 4B with per-group weights (426 arrays) cost ~0.35 ms of host time per step.
        self._param_leaves, treedef = jax.tree.flatten(params)
        self._jitted = jax.jit(partial(_step_on_leaves, treedef, model_def, mixer_set), static_argnums=(4,),
                               donate_argnums=(1, 2))  # fmt: skip
        self._prompt_jitted = jax.jit(partial(_prompt_step_on_leaves, treedef, model_def, mixer_set, num_top_logprobs),
                                      static_argnums=(5,), donate_argnums=(1, 2))  # fmt: skip
        self._layouts: dict[tuple[int, int, int], InputLayout] = {}  # by step key
        self._row_jitted = {"sample": jax.jit(sampler_step, donate_argnums=(2, 3)),
                            "top": jax.jit(partial(top_logprobs, num_top=num_top_logprobs)),
                            MARK_PROMPT: jax.jit(mark_prompt_tokens, donate_argnums=0),
                            COPY_PREFIX: jax.jit(copy_prefix, donate_argnums=(0, 1))}  # fmt: skip
        # Compiled programs saved on disk (program_store: its directory), so a warm start skips lowering.
        self._background: threading.Thread | None = None  # compile_in_background's thread
        self._stop_background = threading.Event()
        self.background_seconds: float | None = None
        self.pads_up = False  # steps may run a larger built program than their bucket's (compile_ready_set)
        self._warm: set[tuple[int, int, int]] = set()  # step programs `warm_up` ran
        self.store = ProgramStore(program_store, self.program_identity()) if program_store else None
        if self.store is not None and mixer_set.name.startswith("pallas") and jax.default_backend() == "gpu":
            # Stored programs call tokamax's Mosaic GPU attention, whose symbols exist once tokamax is imported
            # (tracing imports it otherwise); without them a program fails to load.
            chunk_attention.tokamax_attention()

    @property
    def num_compiles(self) -> int:
        """Step programs compiled (the row programs are counted apart, in num_row_compiles)."""
        return len(self.compile_seconds)

    @property
    def num_row_compiles(self) -> int:
        return len(self.row_compile_seconds)

    @property
    def num_prompt_compiles(self) -> int:
        """Prompt-logprobs step programs compiled."""
        return len(self.prompt_compile_seconds)

    def programs_built(self) -> int:
        """Step, row and prompt-logprobs programs built (compiled or loaded)."""
        return self.num_compiles + self.num_row_compiles + self.num_prompt_compiles

    def programs_total(self) -> int:
        """Programs of the bucket set: what `compile_all` builds."""
        buckets = self.buckets
        return len(buckets.keys()) + len(buckets.row_programs()) + len(buckets.prompt_logprobs_chunk)

    # ---- inputs ------------------------------------------------------------------------------------------
    def _page_table(self, rows: list, pad_to: int) -> np.ndarray:
        """rows: the step's DecodeRows or PrefillChunks. A request holds the same pages from admission to finish,
        so each row's pages are converted to an array once and reused while the request steps: filling a batch-256
        table from tuples of 66 ids took 0.55 ms a step on the CPU, from the arrays 0.09 ms."""
        table = np.full((pad_to, self.page_table_width), TRASH_PAGE, np.int32)
        cache = self._page_arrays
        if len(cache) > 4 * max(pad_to, 64):  # requests that stopped stepping: drop them all, keep this step's
            cache.clear()
        for i, row in enumerate(rows):
            entry = cache.get(row.request_id)
            if entry is None or entry[0] is not row.page_ids:
                entry = cache[row.request_id] = (row.page_ids, np.asarray(row.page_ids, np.int32))
            table[i, : len(entry[1])] = entry[1]
        return table

    def _decode_side(self, plan: StepPlan, size: int) -> DecodeSide:
        rows = plan.decode
        slots = np.full(size, self.trash_slot, np.int32)
        positions = np.zeros(size, np.int32)
        slots[: len(rows)] = [r.slot for r in rows]
        positions[: len(rows)] = [r.position for r in rows]
        page_table = self._page_table(rows, size)
        return DecodeSide(tokens=None, positions=positions, slots=slots, page_table=page_table)

    def _prefill_side(self, plan: StepPlan, num_rows: int, chunk: int) -> PrefillSide:
        tokens = np.zeros((num_rows, chunk), np.int32)
        start, lengths = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
        slots = np.full(num_rows, self.trash_slot, np.int32)
        for i, c in enumerate(plan.prefill):
            tokens[i, : len(c.token_ids)] = c.token_ids
            start[i], lengths[i], slots[i] = c.start, len(c.token_ids), c.slot
        page_table = self._page_table(plan.prefill, num_rows)
        return PrefillSide(tokens=tokens, start=start, lengths=lengths, slots=slots, page_table=page_table)

    def inputs_for(self, plan: StepPlan, key) -> StepInputs:
        b, p, t = key
        decode = self._decode_side(plan, b) if b else None
        prefill = self._prefill_side(plan, p, t) if p else None
        return StepInputs(decode=decode, prefill=prefill)

    # ---- compile -----------------------------------------------------------------------------------------
    def _abstract_inputs(self, key) -> StepInputs:
        b, p, t = key
        w = self.page_table_width
        i32 = partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        decode = DecodeSide(None, i32((b,)), i32((b,)), i32((b, w))) if b else None
        prefill = PrefillSide(i32((p, t)), i32((p,)), i32((p,)), i32((p,)), i32((p, w))) if p else None
        return StepInputs(decode, prefill)

    def input_layout(self, key) -> InputLayout:
        """How step program `key` takes its inputs: one packed int32 array (`InputLayout`)."""
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = InputLayout.of(self._abstract_inputs(key))
        return layout

    def lowering_args(self, key) -> tuple:
        """The arguments that trace step program `key` (`self._jitted`), its static layout last."""
        layout = self.input_layout(key)
        return self._param_leaves, self.cache, self.token_state, layout.abstract(), layout

    def _lower(self, key):
        return self._jitted.lower(*self.lowering_args(key))

    def _lower_prompt_program(self, t: int):
        layout = self.input_layout((0, 1, t))
        targets = jax.ShapeDtypeStruct((t,), jnp.int32)
        return self._prompt_jitted.lower(self._param_leaves, self.cache, self.token_state, layout.abstract(), targets,
                                         layout)  # fmt: skip

    def _lower_row_program(self, key: tuple[str, int]):
        kind, r = key
        i32, f32 = partial(jax.ShapeDtypeStruct, dtype=jnp.int32), partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
        logits = f32((r, self.model_def.cfg.vocab_size))
        if kind == "top":
            return self._row_jitted["top"].lower(logits, i32((r,)))
        if kind == COPY_PREFIX:
            pages = i32((self.page_table_width,))
            return self._row_jitted[COPY_PREFIX].lower(self.cache, self.prompt_mask, i32(()), i32(()), pages, pages)
        if kind == MARK_PROMPT:
            return self._row_jitted[MARK_PROMPT].lower(self.prompt_mask, i32((self.buckets.prefill_rows[-1],)),
                                                       i32((r,)), i32((r,)))  # fmt: skip
        u32 = jax.ShapeDtypeStruct((r,), jnp.uint32)
        rows = SamplingRows(f32((r,)), i32((r,)), f32((r,)), f32((r,)), u32, u32, i32((r,)),
                            i32((r, MAX_LOGIT_BIAS)), f32((r, MAX_LOGIT_BIAS)), f32((r,)), f32((r,)), f32((r,)),
                            i32((r, self.mask_words)))  # fmt: skip
        return self._row_jitted["sample"].lower(logits, rows, self.token_state, self.output_counts, self.prompt_mask,
                                                i32((r,)), i32((r,)))  # fmt: skip

    def program_identity(self) -> str:
        """What decides every program besides its key: the model, kernels, shapes and limits (ProgramStore)."""
        params = jax.tree.map(lambda x: (x.shape, str(x.dtype)), self.params)
        return "\n".join(map(repr, (self.model_def.cfg, str(self.model_def.dtype), self.mixers.name, self.overlaps,
                                     self.num_top, self.page_table_width, self.spec, self.buckets,
                                     jax.tree.structure(self.params), jax.tree.leaves(params))))  # fmt: skip

    def compiler_options(self, family: str, key) -> dict | None:
        """XLA options of one program: on a GPU, step programs skip rematerialization (NO_REMATERIALIZATION), those
        with decode rows and two logit rows or more take PINNED_GEMMS, prefill-only ones PREFILL_WITHOUT_GRAPHS, and
        under `stream` the unified ones CONCURRENT_GRAPH."""
        options = {}
        if family == "step" and jax.default_backend() == "gpu":
            options |= gpu_step_options(key)
        if family == "step" and key[0] and key[1] and self.overlaps:
            options |= CONCURRENT_GRAPH
        return options or None

    def _family(self, family: str):
        """(lower, executables, compile seconds) of a program family: step, row or prompt (-logprobs)."""
        return {"step": (self._lower, self.executables, self.compile_seconds),
                "row": (self._lower_row_program, self.row_executables, self.row_compile_seconds),
                "prompt": (self._lower_prompt_program, self.prompt_executables, self.prompt_compile_seconds)}[family]  # fmt: skip

    @staticmethod
    def _program_name(family: str, key) -> str:
        return "-".join(map(str, (family, *(key if isinstance(key, tuple) else (key,)))))

    def _finish(self, family: str, key, executable, seconds: float, lower_seconds: float | None) -> object:
        _, executables, compile_seconds = self._family(family)
        executables[key], compile_seconds[key] = executable, seconds
        how = "loaded" if lower_seconds is None else f"compiled ({lower_seconds:.2f}s of it lowering)"
        if family == "step":
            memory = executable.memory_analysis()
            self.temp_bytes[key] = getattr(memory, "temp_size_in_bytes", 0) if memory is not None else 0
            log.info("step B=%d P=%d T=%d %s in %.2fs; %.1f MiB scratch", *key, how, seconds,
                     self.temp_bytes[key] / 2**20)  # fmt: skip
        else:
            log.info("%s program %s %s in %.2fs", family, key, how, seconds)
        return executable

    def _stored(self, family: str, key) -> bool:
        return self.store is not None and self.store.has(self._program_name(family, key))

    def _load(self, family: str, key) -> object | None:
        """The program from the store, registered, or None."""
        if self.store is None:
            return None
        start = time.perf_counter()
        executable = self.store.load(self._program_name(family, key))
        if executable is None:
            return None
        return self._finish(family, key, executable, time.perf_counter() - start, None)

    def _compile_lowered(self, family: str, key, lowered, lower_seconds: float) -> object:
        """XLA's compile of a lowered program (it releases the GIL: compile_all runs several at once), saved to the
        store unless XLA's cache served it (program_store), and registered with its lower + compile seconds."""
        start = time.perf_counter()
        options = self.compiler_options(family, key)
        executable, compiled_here = compile_noting_cache(lowered, options)
        seconds = lower_seconds + time.perf_counter() - start
        if self.store is not None and compiled_here:
            self.store.save(self._program_name(family, key), executable)
        return self._finish(family, key, executable, seconds, lower_seconds)

    def _build(self, family: str, key) -> object:
        """The program of `key`: from the store, or lowered and compiled now."""
        executable = self._load(family, key)
        if executable is not None:
            return executable
        lower = self._family(family)[0]
        start = time.perf_counter()
        lowered = lower(key)
        return self._compile_lowered(family, key, lowered, time.perf_counter() - start)

    def row_program(self, kind: str, r: int) -> object:
        """The compiled row program (compiled now if it was not: a test asserts that serving never does)."""
        key = (kind, r)
        return self.row_executables.get(key) or self._build("row", key)

    def compile(self, key) -> object:
        return self._build("step", key)

    def prompt_program(self, t: int) -> object:
        """The compiled prompt-logprobs step of chunk bucket t, compiled now if it was not: only while the background
        build has not reached it yet (the tests assert that an engine built ahead never does)."""
        return self.prompt_executables.get(t) or self._build("prompt", t)

    def compile_all(self, progress=None, workers: int | None = None, keys=None, rows=None, stop=None,
                    prompts=None) -> float:  # fmt: skip
        """Builds every bucket not built yet (or those of `keys`), and every row program and prompt-logprobs
        program, and returns the wall seconds it took. Programs in the store are loaded first, in `workers`
        threads (on the H200, 16 4B step programs loaded in 12.7 s one after another, 2.7 s in 8 threads). The
        others are traced and lowered here, one after another (they hold the GIL), and XLA's compiles, which
        release it, run in the threads, so start-up scales with the host's cores instead of the bucket count.
        progress(total), if given, returns a bar (`update(n)`, `close()`) advanced as each program is ready,
        from the start: lowering overlaps the compiles, so the bar moves while programs are still lowered.
        rows, prompts: the row and prompt-logprobs programs to build (default: all); stop: an Event that ends the
        lowering loop when set. Prompt-logprobs programs go first: a request that needs one before it is built
        compiles it on the engine thread (`prompt_program`)."""
        start = time.perf_counter()
        wanted = {"prompt": self.buckets.prompt_logprobs_chunk if prompts is None else prompts,
                  "step": self.buckets.keys() if keys is None else keys,
                  "row": self.buckets.row_programs() if rows is None else rows}  # fmt: skip
        jobs = [(family, key) for family, family_keys in wanted.items() for key in family_keys
                if key not in self._family(family)[1]]  # fmt: skip
        workers = workers or min(MAX_COMPILE_WORKERS, os.cpu_count() or 1)
        bar = progress(len(jobs)) if progress is not None else None
        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="compile") as pool:
                stored = [job for job in jobs if self._stored(*job)]
                for loaded in pool.map(lambda job: self._load(*job), stored):
                    if loaded is not None and bar is not None:
                        bar.update(1)
                futures = []
                for family, key in jobs:
                    if stop is not None and stop.is_set():
                        break
                    if key in self._family(family)[1]:
                        continue
                    lower_start = time.perf_counter()
                    lowered = self._family(family)[0](key)
                    future = pool.submit(self._compile_lowered, family, key, lowered, time.perf_counter() - lower_start)
                    if bar is not None:
                        future.add_done_callback(lambda _: bar.update(1))
                    futures.append(future)
                for future in as_completed(futures):
                    future.result()
        finally:
            if bar is not None:
                bar.close()
        return time.perf_counter() - start

    def compile_ready_set(self, progress=None) -> float:
        """Builds `Buckets.ready_keys` and their row programs: enough to serve, each plan padded up to a built
        program (`key_for`). The prompt-logprobs programs come first in the background build instead: each cost
        the tiny server's cold start ~6-10 s on the 2-core CPU (three of them: 57 s to ready against 34 s). Programs
        in the store are all loaded too: loading is cheap, and the ones loaded are warmed up with the rest. Returns
        the wall seconds."""
        ready = self.buckets.ready_keys()
        self.pads_up = True
        keys = list(dict.fromkeys(ready + [k for k in self.buckets.keys() if self._stored("step", k)]))
        rows = self.buckets.rows_of(ready) + [k for k in self.buckets.row_programs() if self._stored("row", k)]
        rows = list(dict.fromkeys(rows))
        prompts = [t for t in self.buckets.prompt_logprobs_chunk if self._stored("prompt", t)]
        return self.compile_all(progress, keys=keys, rows=rows, prompts=prompts)

    def compile_in_background(self, workers: int = 1) -> threading.Thread:
        """Builds the rest of the program set in a thread while the engine serves; each program is used as soon as
        it and its row programs are built. `stop_background` ends it after the program being compiled."""

        def run():
            try:
                seconds = self.compile_all(workers=workers, stop=self._stop_background)
            except Exception:  # the ready set still serves every plan, padded
                log.exception("the background build failed; steps keep padding up to the programs built")
                return
            self.background_seconds = seconds
            log.info("built the other programs in the background in %.1fs", seconds)

        self._background = threading.Thread(target=run, name="background-compile", daemon=True)
        self._background.start()
        return self._background

    def stop_background(self, timeout: float | None = None) -> None:
        self._stop_background.set()
        if self._background is not None:
            self._background.join(timeout)

    def wait_for_background(self, timeout: float | None = None) -> None:
        if self._background is not None:
            self._background.join(timeout)

    def _servable(self, key) -> bool:
        rows = key[0] + key[1]
        return key in self.executables and all((kind, rows) in self.row_executables for kind in ROW_PROGRAMS)

    def key_for(self, plan: StepPlan) -> tuple[int, int, int]:
        """The plan's bucket (`Buckets.key_for`), or after `compile_ready_set`, while the program set is still being
        built, the smallest built program with the same sides that holds it: decode rows, chunks and chunk tokens
        all at least the plan's bucket's. Otherwise a missing program is compiled when first launched."""
        key = self.buckets.key_for(plan)
        if not self.pads_up or plan.prompt_logprobs or self._servable(key):
            return key
        b, p, t = key
        covers = [k for k in list(self.executables) if (k[0] > 0) == (b > 0) and (k[1] > 0) == (p > 0)
                  and k[0] >= b and k[1] >= p and k[2] >= t and self._servable(k)]  # fmt: skip
        return min(covers, key=lambda k: (k[0] + k[1] * k[2], k)) if covers else key

    # ---- step costs --------------------------------------------------------------------------------------
    def padding_inputs(self, key) -> StepInputs:
        """Inputs of bucket `key` whose every row is padding (trash slot, trash page), prefill rows full: a
        run of the program writes nothing any request reads."""
        b, p, t = key
        w = self.page_table_width
        trash = partial(np.full, fill_value=self.trash_slot, dtype=np.int32)
        decode = DecodeSide(None, np.zeros(b, np.int32), trash(b), np.zeros((b, w), np.int32))
        prefill = PrefillSide(np.zeros((p, t), np.int32), np.zeros(p, np.int32), np.full(p, t, np.int32), trash(p),
                              np.zeros((p, w), np.int32))  # fmt: skip
        return StepInputs(decode if b else None, prefill if p else None)

    def warm_up(self, keys=None) -> float:
        """Runs the compiled step programs of `keys` (default: every one not run yet) WARM_UP_RUNS times on padding
        inputs, so that the first requests do not pay a program's first runs (on a GPU: loading its kernels, the
        libraries' first calls, recording its CUDA graph). Call it from the thread that launches steps: the
        programs take the caches. Returns the seconds."""
        start = time.perf_counter()
        for key in self.unwarmed() if keys is None else keys:
            inputs = self.padding_inputs(key)
            for _ in range(WARM_UP_RUNS):
                self._run_on_padding(key, self.executables[key], inputs)
        jax.block_until_ready((self.cache, self.token_state))
        return time.perf_counter() - start

    def _run_on_padding(self, key, executable, inputs: StepInputs):
        """One run of step program `key` on `padding_inputs(key)` (it writes nothing a request reads); it counts as
        the program's warm-up. Returns its token outputs."""
        packed = self.input_layout(key).pack(inputs)
        self.cache, self.token_state, outputs, _ = executable(self._param_leaves, self.cache, self.token_state, packed)
        self._warm.add(key)
        return outputs

    def unwarmed(self) -> list[tuple[int, int, int]]:
        """Built step programs that `warm_up` has not run yet."""
        return [key for key in list(self.executables) if key not in self._warm]

    @property
    def building(self) -> bool:
        """True while `compile_in_background`'s thread runs."""
        return self._background is not None and self._background.is_alive()

    def measure_step_costs(self, keys=None, repeats: int = 5) -> dict[tuple[int, int, int], float]:
        """Device seconds of each compiled step program on padding inputs: what the host sizes overlapped steps
        from (`scheduler.OverlapBudget`). After one waited-for run (it also pays one-time costs: autotuning,
        allocation), `repeats` runs are dispatched back to back and waited for once, as the engine dispatches
        steps, so that the host's dispatch overlaps the device and the figure is the device's time per step."""
        costs = {}
        for key in keys or [k for k in self.buckets.keys() if k[0]]:
            executable = self.executables.get(key) or self.compile(key)
            inputs = self.padding_inputs(key)
            for runs in (1, repeats):
                start = time.perf_counter()
                for _ in range(runs):
                    outputs = self._run_on_padding(key, executable, inputs)
                jax.block_until_ready(outputs)
            costs[key] = (time.perf_counter() - start) / repeats
        return costs

    # ---- launch ------------------------------------------------------------------------------------------
    def launch(self, plan: StepPlan, sampling: list) -> StepHandle:
        """Dispatch one step; returns at once. `sampling` has one entry per decode row, then per chunk."""
        key = self.key_for(plan)
        inputs = self.inputs_for(plan, key)
        prompt_outputs = ()
        if plan.prompt_logprobs:
            (tokens, chosen), logits, prompt_outputs = self._launch_prompt_logprobs(plan, key, inputs)
        else:
            executable = self.executables.get(key) or self.compile(key)
            self.cache, self.token_state, (tokens, chosen), logits = executable(
                self._param_leaves, self.cache, self.token_state, self.input_layout(key).pack(inputs)
            )
        self._mark_prompts(plan, sampling[len(plan.decode) :])
        if any(row.needs_sampler for row in sampling):
            tokens, chosen = self._sample(plan, key, inputs, sampling, logits, tokens)
        top_ids = top_lp = None
        if any(row.logprobs for row in sampling):
            chosen, top_ids, top_lp = self.row_program("top", key[0] + key[1])(logits, tokens)
        self._copy_prefixes(plan)
        if all(row.logprobs is None for row in sampling):
            chosen = None  # nobody reads it: its copy to the host is not started (each costs the launch host time)
        outputs = (tokens, chosen, top_ids, top_lp)
        for output in (*outputs, *prompt_outputs):  # start the device-to-host copies now; the host reads them later
            if output is not None:
                output.copy_to_host_async()
        return StepHandle(plan, key, outputs, time.perf_counter(), prompt_outputs)

    def _launch_prompt_logprobs(self, plan: StepPlan, key, inputs: StepInputs) -> tuple:
        """The prompt-logprobs program for the plan's one chunk; (greedy outputs, last logits, prompt outputs)."""
        targets = np.zeros(key[2], np.int32)  # padding positions score token 0, and nobody reads them
        chunk = plan.prefill[0]
        targets[: len(chunk.targets)] = chunk.targets
        self.cache, self.token_state, greedy_outputs, logits, prompt_outputs = self.prompt_program(key[2])(
            self._param_leaves, self.cache, self.token_state, self.input_layout(key).pack(inputs), targets
        )
        return greedy_outputs, logits, prompt_outputs

    def _sample(self, plan: StepPlan, key, inputs: StepInputs, sampling: list, logits, tokens) -> tuple:
        """Launches the sampler after the step: the sampled rows' tokens replace the greedy ones."""
        num_decode, rows_total = len(plan.decode), key[0] + key[1]
        # Output rows are [B decode bucket | P prefill bucket]: pad each side to its bucket.
        padded = [*sampling[:num_decode], *[None] * (key[0] - num_decode), *sampling[num_decode:]]
        rows = SamplingRows.from_rows(padded, rows_total, self._token_masks(padded, rows_total))
        slots = np.concatenate([side.slots for side in (inputs.decode, inputs.prefill) if side is not None])
        sampler = self.row_program("sample", rows_total)
        self.token_state, self.output_counts, tokens, chosen = sampler(
            logits, rows, self.token_state, self.output_counts, self.prompt_mask, slots, tokens
        )
        return tokens, chosen

    def _mark_prompts(self, plan: StepPlan, chunk_sampling: list) -> None:
        """Launches the prompt-token marker for the chunks of requests with a repetition penalty, before the
        sampler that reads it (the device runs launches in order). `chunk_sampling`: one entry per chunk."""
        chunks = [c for c, row in zip(plan.prefill, chunk_sampling, strict=True) if row.repetition_penalty != 1]
        if not chunks:
            return
        size = self.buckets.chunk[-1]  # a step's prefill tokens never exceed the largest chunk bucket
        fresh = np.full(self.buckets.prefill_rows[-1], self.trash_slot, np.int32)
        starts = [c.slot for c in chunks if c.start == 0]
        fresh[: len(starts)] = starts
        token_slots, token_ids = np.full(size, self.trash_slot, np.int32), np.zeros(size, np.int32)
        marked = [(c.slot, token) for c in chunks for token in c.token_ids]
        token_slots[: len(marked)], token_ids[: len(marked)] = zip(*marked, strict=True)
        self.prompt_mask = self.row_program(MARK_PROMPT, size)(self.prompt_mask, fresh, token_slots, token_ids)

    def _copy_prefixes(self, plan: StepPlan) -> None:
        """Launches the plan's `StateCopy`s after its step and its row programs (the device runs launches in order,
        so a copy reads what the step wrote, and the request it feeds reads the copy in a later step)."""
        for copy in plan.copies:
            pages = np.full((2, self.page_table_width), TRASH_PAGE, np.int32)
            pages[0, : len(copy.src_pages)], pages[1, : len(copy.dst_pages)] = copy.src_pages, copy.dst_pages
            self.cache, self.prompt_mask = self.row_program(COPY_PREFIX, 1)(
                self.cache, self.prompt_mask, np.int32(copy.src_slot), np.int32(copy.dst_slot), pages[0], pages[1]
            )

    def _token_masks(self, rows: list, num_rows: int):
        """[num_rows, mask_words] int32: each grammar row's packed mask, every token allowed in the others."""
        if all(row is None or row.token_mask is None for row in rows):
            if num_rows not in self._no_masks:
                self._no_masks[num_rows] = jax.device_put(np.full((num_rows, self.mask_words), -1, np.int32))
            return self._no_masks[num_rows]
        allowed = np.full((num_rows, self.mask_words), -1, np.int32)
        for i, row in enumerate(rows):
            if row is not None and row.token_mask is not None:
                allowed[i] = row.token_mask
        return allowed

    def cache_lost(self) -> bool:
        """True when a failed step consumed the donated caches."""
        arrays = (self.cache.k_pages, self.cache.ssm, self.token_state, self.output_counts, self.prompt_mask)
        return any(x.is_deleted() for x in arrays)

    def reset_cache(self) -> None:
        """After a failed step the donated buffers may be gone: start from fresh caches."""
        self.cache = new_cache(self.model_def.cfg, self.spec, self.model_def.dtype)
        self.token_state = jnp.zeros(self.spec.num_slots, jnp.int32)
        self.output_counts = jnp.zeros_like(self.output_counts)
        self.prompt_mask = jnp.zeros_like(self.prompt_mask)
