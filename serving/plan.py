"""The scheduler-to-runner contract: one `StepPlan` per step, plus the host-side `Request` state.

A plan is considered launched the moment `Scheduler.schedule()` returns it: the scheduler has already
advanced every counter as if the step ran. The runner turns a plan into padded bucket inputs:
decode rows and prefill chunks are padded with rows that point at the trash slot
(`SlotPool.trash_slot`) and the trash page (`pools.TRASH_PAGE`).

Token positions are 0-based indices into the request's sequence `prompt_ids + output_ids`, which is
also the index of the KV entry the token writes: position p lives in `page_ids[p // page_size]` at
offset `p % page_size`.
"""

from __future__ import annotations

import dataclasses
import enum


def power_of_two_buckets(largest: int, smallest: int = 1) -> tuple[int, ...]:
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    return (*buckets, largest)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for size in buckets:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def chunk_buckets(max_prefill_tokens: int) -> tuple[int, ...]:
    """Tokens per prompt chunk of the step programs."""
    return power_of_two_buckets(max_prefill_tokens, smallest=min(16, max_prefill_tokens))


# The shortest chunk bucket of a step that packs several chunks: below it a prefill step costs about the same
# (4B on the H200: 4.7 ms at 16 tokens, 6.7 ms at 128), so shorter chunks are padded to it and the packed programs
# stay few.
PACKED_MIN_CHUNK = 64


def packed_chunk_buckets(max_prefill_tokens: int) -> tuple[int, ...]:
    """Tokens per chunk of the prefill-only programs that carry several chunks."""
    return tuple(t for t in chunk_buckets(max_prefill_tokens) if t >= min(PACKED_MIN_CHUNK, max_prefill_tokens))


def packed_chunk_cap(num_chunks: int, max_prefill_tokens: int, max_prefill_chunks: int,
                     beside_decode: bool = False) -> int:  # fmt: skip
    """The longest chunk a step of `num_chunks` chunks may carry (0: none). Its program pads every chunk to a
    bucket of `packed_chunk_buckets`, and the programs compute at most `max_prefill_tokens` padded tokens, so that
    packing short prompts never costs more than one full chunk: in a prefill-only step P chunks (P a row bucket)
    of T-token buckets with P x T <= max_prefill_tokens (`runner.Buckets.keys`). Beside decode rows the chunks are
    short ones, T <= max_prefill_tokens / max_prefill_chunks (`packed_unified_chunk_buckets`), so that one
    program of the most chunks holds every such step."""
    if num_chunks == 1:
        return max_prefill_tokens
    if num_chunks > max_prefill_chunks:
        return 0
    if beside_decode:
        return max(packed_unified_chunk_buckets(max_prefill_tokens, max_prefill_chunks), default=0)
    rows = bucket_for(num_chunks, power_of_two_buckets(max_prefill_chunks))
    return max((t for t in packed_chunk_buckets(max_prefill_tokens) if rows * t <= max_prefill_tokens), default=0)


def packed_unified_chunk_buckets(max_prefill_tokens: int, max_prefill_chunks: int) -> tuple[int, ...]:
    """Tokens per chunk of the programs that carry several chunks beside decode rows: the packed buckets within
    max_prefill_tokens / max_prefill_chunks (none with one chunk a step)."""
    if max_prefill_chunks == 1:
        return ()
    buckets = packed_chunk_buckets(max_prefill_tokens)
    return tuple(t for t in buckets if t * max_prefill_chunks <= max_prefill_tokens)


PREFILL = "prefill"
DECODE = "decode"
UNIFIED = "unified"
IDLE = "idle"
# Under `--decode-overlap stream` (pegainfer's action names): a step that launches a prompt chunk beside decode
# rows, the chunk's prefill mixers on their own stream; and a decode-only step launched while such a step is
# still in flight (not yet read back by the host).
OVERLAP_LAUNCH = "overlap_launch"
OVERLAP_DECODE = "overlap_decode"
# Engine events, never plan actions: the host reads an overlapped step back (its chunk is complete), or blocks
# on one because the last decoder retired while it was in flight.
OVERLAP_COMPLETE = "overlap_complete"
OVERLAP_WAIT = "overlap_wait"
STEP_ACTIONS = (PREFILL, DECODE, UNIFIED, IDLE, OVERLAP_LAUNCH, OVERLAP_DECODE)


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """Feed one token of a request whose prompt is fully prefilled, and sample the next one.

    The fed token is not in the plan: it is the token the previous step sampled for this request. It
    stays on the device (the host reads it one step late), and the runner gathers it from the previous
    step's sampled tokens by request id.
    """

    request_id: str
    # GDN state slot: the recurrent and conv states are read from and written back to it.
    slot: int
    # Index of the fed token in the sequence = tokens already in the KV cache. Its K/V are written here.
    position: int
    # The request's whole page table, reserved at admission; pages past `position` are still unused.
    page_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Feed prompt tokens `[start, start + len(token_ids))` of one request into its caches."""

    request_id: str
    # GDN state slot. When `start == 0` the slot may hold a previous owner's state: start from zeros.
    slot: int
    # Position of `token_ids[0]`; the caches already hold positions `[0, start)` of this request.
    start: int
    # The prompt tokens of this chunk, in order.
    token_ids: tuple[int, ...]
    # The request's whole page table, reserved at admission.
    page_ids: tuple[int, ...]
    # This chunk completes the prompt: sample the first output token from its last position's logits.
    is_last: bool
    # In a prompt-logprobs step: the prompt tokens [start + 1, end + 1) whose logprobs the chunk's positions
    # return, one per position (the last chunk's has one fewer: its last position predicts the first output token).
    targets: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """One past the position of the chunk's last token."""
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StateCopy:
    """After the step, copy a prompt prefix's caches from one request to another that has the same prompt (the
    samples of one `n` > 1 request): the GDN recurrent and conv states of `src_slot` into `dst_slot`, and the KV
    of pages `src_pages` into `dst_pages` (the pages that hold the prefix), so that the copy prefills none of it."""

    request_id: str  # the request that receives the copy
    src_slot: int
    dst_slot: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the runner needs for one step. Decode rows and chunks are in admission order."""

    # Increases by one on every `schedule()` call, idle steps included.
    step_id: int
    # One row per request that decodes in this step.
    decode: tuple[DecodeRow, ...]
    # Prompt chunks to prefill in this step (at most `max_prefill_chunks`, one per request).
    prefill: tuple[PrefillChunk, ...]
    # "prefill" (chunks only), "decode" (rows only), "unified" (both in one step) or "idle" (nothing); under
    # stream overlap "overlap_launch" in place of "unified", and "overlap_decode" for a decode step behind it.
    action: str
    # Prefill token budget the policy granted this step; `num_prefill_tokens <= budget`.
    budget: int
    # A prompt-logprobs step: one chunk and no decode rows, whose program also returns the logprob of every next
    # prompt token (`PrefillChunk.targets`).
    prompt_logprobs: bool = False
    # Prompt prefixes copied between requests once this step has run (`StateCopy`).
    copies: tuple[StateCopy, ...] = ()

    def __post_init__(self):
        assert self.action in STEP_ACTIONS, self.action
        assert self.num_prefill_tokens <= self.budget
        assert not self.prompt_logprobs or (not self.decode and len(self.prefill) == 1)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.prefill)

    @property
    def num_decode_rows(self) -> int:
        return len(self.decode)


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"  # queued, holds no slot and no page
    PREFILLING = "prefilling"  # admitted: holds its slot and all its pages, prompt not fully fed
    DECODING = "decoding"  # prompt fully fed; decodes until `remaining_tokens == 0` or finished
    FINISHED = "finished"  # finished or aborted; its slot and pages are back in the pools


@dataclasses.dataclass(eq=False)
class Request:
    """Host-side state of one request as scheduling sees it; the scheduler owns and mutates it.

    `Engine.submit` creates it next to the request's `Generation` (engine.py), and the scheduler holds it
    from `add` to `finish`: the prompt, the length limit, the slot and pages, and counters that move when
    a step is launched. Sampling, text and the consumer are the `Generation`'s. `max_tokens` is copied
    from the request's `GenerationParams` because this module and the scheduler import no engine code.
    """

    request_id: str
    prompt_ids: list[int]
    # Output tokens to sample at most (the length limit); 0: the prompt is only fed (its logprobs are the answer).
    max_tokens: int
    # The logprobs of the prompt's tokens are returned: each of its chunks runs in a prompt-logprobs step.
    prompt_logprobs: bool = False
    # Prompt tokens already fed into the caches (counted when the chunk's step is launched).
    num_computed_tokens: int = 0
    # Output tokens sampled so far, counted when the step that samples them is launched: the host
    # learns their values one step later.
    num_output_tokens: int = 0
    # GDN state slot, from admission until finish; None while waiting or after finish.
    slot: int | None = None
    # KV pages for the whole lifetime (prompt + max_tokens), allocated at admission.
    page_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    # Set by `Scheduler.finish`: "stop", "length", "abort", ... as the engine reports it.
    finish_reason: str | None = None
    # `step_id` of the next plan at the time the request was added: queueing delay is in steps.
    arrival_step: int = 0
    # Each token must be read by the host before the next one is launched: a grammar's mask for the next
    # token depends on it. Such a request gets no decode row while its last sampled token is in flight.
    waits_for_tokens: bool = False
    # Output tokens the host has read back (`Scheduler.token_read`); counted only when `waits_for_tokens`.
    num_read_tokens: int = 0
    # Another sample of the same prompt (`n` > 1): the id of the request that prefills it for both. This one waits
    # until that one's caches hold all but the prompt's last token, takes a copy of them (`StateCopy`), and feeds
    # only that last token itself, which samples its own first token.
    fork_of: str | None = None
    # Set on the request that prefills for others: its chunk ends here (all but the last prompt token), and the
    # step of that chunk copies its caches to every sample that waits for them. 0: no copy.
    fork_point: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def remaining_prompt(self) -> int:
        """Prompt tokens not yet fed into the caches."""
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def feedable(self) -> int:
        """Prompt tokens the next chunk may take: up to the fork point while it is ahead, else the rest."""
        if self.num_computed_tokens < self.fork_point:
            return self.fork_point - self.num_computed_tokens
        return self.remaining_prompt

    @property
    def remaining_tokens(self) -> int:
        """Output tokens still to be sampled before the length limit."""
        return self.max_tokens - self.num_output_tokens

    @property
    def awaits_token(self) -> bool:
        """Its next row must wait: its last sampled token has not been read back yet."""
        return self.waits_for_tokens and self.num_read_tokens < self.num_output_tokens

    @property
    def total_reserved_tokens(self) -> int:
        """Tokens the KV reservation covers. The last sampled token is never fed, so one is spare."""
        return self.num_prompt_tokens + self.max_tokens
