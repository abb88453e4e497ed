"""Host-only continuous-batching scheduler: FCFS admission with full reservation, chunked prefill under a
per-step token budget, and one decode row per running request that still has tokens to sample.

One `schedule()` call is one step: admit -> decode rows -> choose the prefill budget -> take prompt
chunks -> return the plan. The plan counts as launched when it is returned, so every counter has
already moved as if the step ran; the device never waits on the host to confirm.

Contract with the engine (it reads sampled tokens one step late):
- `finish(request_id, reason)` when it reads EOS / a stop string / the length limit. A request whose
  `remaining_tokens` reached 0 at schedule time gets no more decode rows but keeps its slot and pages
  until that call, because its last token has not been read yet.
- `abort(request_id)` when the client goes away, in any state.
- `token_read(request_id)` when it reads a sampled token of a request that `waits_for_tokens` (one under a
  grammar): such a request gets its next decode row only after that, so it decodes at most every other
  step while other requests keep a row in every step.
- Both free the slot and pages at once, and the very next plan may hand them to another request,
  although the step in flight may still write them (`finish` usually retires a request that also has
  a row in that step). That is safe because the device runs steps in launch order, one compiled
  program at a time: the new owner's writes land after the old owner's. So the engine needs no drain
  for the caches; it calls these between `schedule()` calls and drops tokens that arrive for requests
  it has retired. A runner that let two steps run at once would have to drain before calling them.
- A `PrefillChunk` with `start == 0` may land on a slot that a finished request left dirty: the runner
  starts such a chunk from zero GDN state instead of reading the slot.

No jax import: this module must stay testable with no device.
"""

from __future__ import annotations

import collections
import dataclasses

from .plan import (
    DECODE,
    IDLE,
    OVERLAP_DECODE,
    OVERLAP_LAUNCH,
    PREFILL,
    UNIFIED,
    DecodeRow,
    PrefillChunk,
    Request,
    RequestStatus,
    StateCopy,
    StepPlan,
    packed_chunk_cap,
)
from .pools import PagePool, SlotPool, pages_needed

POLICIES = ("off", "auto")
DECODE_OVERLAPS = ("off", "stream")


@dataclasses.dataclass(frozen=True)
class OverlapBudget:
    """The prompt tokens an overlapped step may carry beside its decode rows, so that it stays within `bound`
    times the decode-only step of the same batch bucket: the decoders wait at most that long for a token while
    a prompt moves. Built from the measured device time of the compiled programs (`from_costs`)."""

    # (decode rows up to, chunk tokens at most), by ascending rows: one entry per decode bucket.
    limits: tuple[tuple[int, int], ...]

    def tokens_for(self, num_decode: int) -> int:
        for rows, tokens in self.limits:
            if num_decode <= rows:
                return tokens
        return self.limits[-1][1]

    @classmethod
    def from_costs(cls, costs: dict[tuple[int, int, int], float], bound: float) -> OverlapBudget:
        """costs: seconds by bucket key (B, P, T), decode-only keys (B, 0, 0) included. Each decode bucket gets
        its largest chunk bucket whose step costs at most `bound` x its decode-only step, and at least its
        smallest chunk bucket, so that a prompt always moves."""
        limits = []
        for b in sorted({key[0] for key in costs if key[0] and not key[1]}):
            chunks = sorted((t, cost) for (rows, p, t), cost in costs.items() if rows == b and p)
            if not chunks:
                continue
            fitting = [t for t, cost in chunks if cost <= bound * costs[(b, 0, 0)]]
            limits.append((b, max(fitting, default=chunks[0][0])))
        if not limits:
            raise ValueError("no unified step costs to size overlapped steps from")
        return cls(tuple(limits))


class RequestRejected(ValueError):
    """The request can never be served with this configuration, however long it waits."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    # Most requests running at once (prefilling + decoding); also the largest decode batch.
    max_batch: int
    # Prompt tokens prefilled per step at most (`--max-prefill-tokens`).
    max_prefill_tokens: int = 1024
    # Tokens per KV page.
    page_size: int
    # KV pages in the device pool, trash page 0 included.
    num_pages: int
    # GDN state slots in the device pool, trash slot `num_slots - 1` included.
    num_slots: int
    # Longest sequence (prompt + max_tokens) a request may reserve.
    max_model_len: int
    # Prefill budget policy: "off" grants `max_prefill_tokens` every step; "auto" is adaptive.
    policy: str = "off"
    # "stream" when the runner overlaps the prefill chunk with decode on separate streams.
    decode_overlap: str = "off"
    # Requests that may each get a prompt chunk in one step (`chunks_beside_decode` in a step with decode rows).
    max_prefill_chunks: int = 1
    # `auto`: a decoder with this many tokens left or fewer makes the step decode-only.
    finishing_window: int = 4
    # Most prompt tokens of one prompt-logprobs step (`StepPlan.prompt_logprobs`); 0: requests for prompt logprobs
    # are rejected.
    prompt_logprobs_chunk: int = 0
    # `--deterministic`: a step carries decode rows or one prompt chunk, never both, and every prompt is cut into
    # chunks of `max_prefill_tokens` from its start, so that the programs a request's tokens pass through, and
    # their shapes, do not depend on what else is running (the runner's half: one decode bucket).
    batch_invariant: bool = False

    @property
    def chunks_beside_decode(self) -> int:
        """Prompt chunks a step with decode rows may carry. Several short ones under `off`, as many as a
        prefill-only step: prompts that arrive while others decode are not fed one a step. One under `stream`,
        whose budget is measured on the one-chunk programs."""
        return self.max_prefill_chunks if self.decode_overlap == "off" else 1

    def __post_init__(self):
        for name in ("max_batch", "max_prefill_tokens", "page_size", "max_model_len", "max_prefill_chunks"):
            _require_int(self, name, minimum=1)
        _require_int(self, "num_pages", minimum=2, why="page 0 is the trash page")
        _require_int(self, "num_slots", minimum=2, why="the last slot is the trash slot")
        _require_int(self, "finishing_window", minimum=0)
        _require_int(self, "prompt_logprobs_chunk", minimum=0)
        if self.prompt_logprobs_chunk > self.max_prefill_tokens:
            raise ValueError(f"prompt_logprobs_chunk ({self.prompt_logprobs_chunk}) must be at most max_prefill_tokens "
                             f"({self.max_prefill_tokens})")  # fmt: skip
        _require_choice(self, "policy", POLICIES)
        _require_choice(self, "decode_overlap", DECODE_OVERLAPS)
        if self.batch_invariant and (self.max_prefill_chunks != 1 or self.decode_overlap != "off"):
            raise ValueError("batch_invariant steps carry one prompt chunk and no decode rows beside it: it needs "
                             f"max_prefill_chunks 1 and decode_overlap 'off', got {self.max_prefill_chunks} and "
                             f"{self.decode_overlap!r}")  # fmt: skip
        if self.num_slots - 1 < self.max_batch:
            raise ValueError(
                f"num_slots ({self.num_slots}) must be at least max_batch + 1 ({self.max_batch + 1}): "
                "every running request needs a GDN slot, and the last slot is the trash slot"
            )


def _require_int(config: SchedulerConfig, name: str, minimum: int, why: str = "") -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{reason}, got {value!r}")


def _require_choice(config: SchedulerConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, overlap_budget: OverlapBudget | None = None):
        self.config = config
        # Under stream overlap, sizes each step's chunk from its decode rows (None: the cap alone).
        self.overlap_budget = overlap_budget
        self._last_action = IDLE
        self._last_scored = False  # the last plan was a prompt-logprobs step
        self.page_pool = PagePool(config.num_pages, config.page_size)
        self.slot_pool = SlotPool(config.num_slots)
        self.waiting: collections.deque[Request] = collections.deque()
        # Admitted requests in admission order (dicts keep insertion order): the order of rows and chunks.
        self.running: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}  # waiting and running, by id
        self._next_step_id = 0
        self._copies: list[StateCopy] = []  # made by the chunks of the plan being built

    # ---- requests in and out -----------------------------------------------------------------------

    def check_request(self, prompt_len: int, max_tokens: int, prompt_logprobs: bool = False) -> None:
        """Raise `RequestRejected` when a request could never be admitted, however long it waited."""
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty: at least one prompt token is needed")
        if max_tokens < 0:
            raise RequestRejected(f"max_tokens must be at least 0, got {max_tokens}")
        if prompt_logprobs and not self.config.prompt_logprobs_chunk:
            raise RequestRejected("prompt logprobs are off: the engine was built with no prompt-logprobs programs")
        total = prompt_len + max_tokens
        if total > self.config.max_model_len:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds the "
                f"maximum model length of {self.config.max_model_len} tokens"
            )
        pages = pages_needed(total, self.config.page_size)
        if pages > self.page_pool.num_total:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {pages} KV pages of "
                f"{self.config.page_size} tokens, but the whole KV cache holds {self.page_pool.num_total}"
            )

    def add(self, request: Request) -> None:
        """Queue a request behind every earlier one (FCFS)."""
        self.check_request(request.num_prompt_tokens, request.max_tokens, request.prompt_logprobs)
        if request.request_id in self._requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
        request.arrival_step = self._next_step_id
        self._join_fork(request)
        self.waiting.append(request)
        self._requests[request.request_id] = request

    def _join_fork(self, request: Request) -> None:
        """A request with `fork_of` takes a copy of that request's prompt prefix when it can: same prompt of 2 tokens
        or more, neither one's prompt scored, that one not yet past the prefix, and steps not batch-invariant (whose
        chunk boundaries must be a lone run's). Otherwise it prefills its prompt itself."""
        leader = self._requests.get(request.fork_of)  # None too when fork_of is None
        prefix = request.num_prompt_tokens - 1
        if (leader is None or leader.prompt_ids != request.prompt_ids or prefix < 1 or self.config.batch_invariant
                or request.prompt_logprobs or leader.prompt_logprobs or leader.num_computed_tokens > prefix):  # fmt: skip
            request.fork_of = None
            return
        leader.fork_point = prefix

    def finish(self, request_id: str, reason: str) -> bool:
        """Retire a request in any state, freeing its slot and pages now. False if the id is unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return True

    def abort(self, request_id: str) -> bool:
        """Cancel a request in any state; its resources go back at once (see the module docstring)."""
        return self.finish(request_id, "abort")

    def token_read(self, request_id: str) -> None:
        """The host has read the request's oldest unread sampled token; a request that `waits_for_tokens` may
        then be given its next decode row."""
        request = self._requests.get(request_id)
        if request is not None:
            assert request.num_read_tokens < request.num_output_tokens, "a token was read before its step launched"
            request.num_read_tokens += 1

    # ---- one step ----------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step and mark it launched. A prompt whose logprobs are returned moves one chunk per
        prompt-logprobs step, a step of its own; while other requests have work, those steps alternate with
        ordinary ones, so that decoders and other prompts wait at most one such step at a time."""
        self._admit_waiting()
        decoders = self._decoders()
        scored = next((r for r in self.running.values() if r.remaining_prompt > 0 and r.prompt_logprobs), None)
        if scored is not None and not (self._last_scored and (decoders or self._prefill_front() is not None)):
            plan = self._prompt_logprobs_plan(scored)
        else:
            plan = self._ordinary_plan(decoders)
        self._next_step_id += 1
        self._last_action, self._last_scored = plan.action, plan.prompt_logprobs
        return plan

    def _decoders(self) -> list[Request]:
        """The requests that get a decode row in an ordinary step: those with tokens left, less those that wait for
        their last token to be read (`waits_for_tokens`)."""
        return [r for r in self.running.values()
                if r.remaining_prompt == 0 and r.remaining_tokens > 0 and not r.awaits_token]  # fmt: skip

    def _ordinary_plan(self, decoders: list[Request]) -> StepPlan:
        # Decoders are picked before any chunk launches: a prompt finished in this step has its first
        # token sampled by this step, so it can only be fed in the next one.
        budget = self._prefill_budget(decoders)
        if self.config.batch_invariant and decoders and budget:
            decoders, budget = self._one_side(decoders, budget)
        decode = tuple(self._launch_decode(request) for request in decoders)
        prefill = tuple(self._launch_chunks(budget, beside_decode=bool(decode)))
        action = step_action(decode, prefill)
        if self.config.decode_overlap == "stream":
            action = overlap_action(action, self._last_action)
        copies, self._copies = tuple(self._copies), []
        return StepPlan(self._next_step_id, decode, prefill, action, budget, copies=copies)

    def _one_side(self, decoders: list[Request], budget: int) -> tuple[list[Request], int]:
        """Under `batch_invariant`, a step that could carry both sides carries one: a prompt chunk after a decode
        step, decode rows after a prefill step, so that decoders and prompts take turns. The chunk keeps the
        whole budget, which under both policies is the front's remainder or `max_prefill_tokens`, whichever is
        less: the chunk boundaries are the same as when the prompt runs alone."""
        if self._prefill_front() is None:
            return decoders, budget
        if self._last_action == PREFILL:
            return decoders, 0
        return [], budget

    def _prompt_logprobs_plan(self, request: Request) -> StepPlan:
        chunk = self._launch_chunk(request, min(request.remaining_prompt, self.config.prompt_logprobs_chunk))
        return StepPlan(self._next_step_id, (), (chunk,), PREFILL, len(chunk.token_ids), prompt_logprobs=True)

    def _admit_waiting(self) -> None:
        # Head-of-line blocking: skipping the front for a smaller request could starve a long one.
        while self.waiting and self._can_admit(self.waiting[0]):
            self._admit(self.waiting.popleft())

    def _can_admit(self, request: Request) -> bool:
        return (
            len(self.running) < self.config.max_batch
            and self.slot_pool.can_allocate()
            and self.page_pool.can_allocate(self._pages_reserved(request))
        )

    def _admit(self, request: Request) -> None:
        # Every page the request can ever need is taken now, so decode never runs out and nothing
        # is ever preempted.
        request.slot = self.slot_pool.allocate()
        request.page_ids = tuple(self.page_pool.allocate(self._pages_reserved(request)))
        request.status = RequestStatus.PREFILLING
        self.running[request.request_id] = request

    def _pages_reserved(self, request: Request) -> int:
        return pages_needed(request.total_reserved_tokens, self.config.page_size)

    def _release(self, request: Request) -> None:
        del self.running[request.request_id]
        self.slot_pool.free(request.slot)
        self.page_pool.free(request.page_ids)
        request.slot = None
        request.page_ids = ()

    def _prefill_budget(self, decoders: list[Request]) -> int:
        """Prompt tokens this step may prefill: the cap under `off`; under `auto`, the adaptive budget of
        pegainfer (the reference this engine reproduces), whose three cases follow."""
        cap = self.config.max_prefill_tokens
        overlapped = self.config.decode_overlap == "stream"
        if overlapped and decoders and self.overlap_budget is not None:
            cap = min(cap, self.overlap_budget.tokens_for(len(decoders)))
        front = self._prefill_front()
        # With nothing decoding there is no inter-token latency to protect: take the whole cap.
        if self.config.policy == "off" or front is None or not decoders:
            return cap
        # Decode-priority tick: requests about to finish get their last tokens from cheap steps. With
        # stream overlap the chunk runs beside decode, so deferring it would only delay prefill.
        window = self.config.finishing_window
        if not overlapped and any(r.remaining_tokens <= window for r in decoders):
            return 0
        # Only the FIFO front's remainder, so a decode step is never inflated by packing later prompts.
        return min(front.remaining_prompt, cap)

    def _prompts_to_feed(self):
        """The running requests with prompt left to feed in ordinary steps, in FCFS order (those whose logprobs
        are returned have steps of their own)."""
        return (r for r in self.running.values()
                if r.remaining_prompt > 0 and not r.prompt_logprobs and not self._waits_for_fork(r))  # fmt: skip

    def _waits_for_fork(self, request: Request) -> bool:
        """It will take a copy of its fork's prefix, which that request has not prefilled yet."""
        leader = self._requests.get(request.fork_of)
        return (
            leader is not None and request.num_computed_tokens == 0 and leader.num_computed_tokens < leader.fork_point
        )

    def _prefill_front(self) -> Request | None:
        return next(self._prompts_to_feed(), None)

    def _launch_decode(self, request: Request) -> DecodeRow:
        # The fed token is the last one sampled; the tokens before it are all in the KV cache.
        position = request.num_prompt_tokens + request.num_output_tokens - 1
        row = DecodeRow(request.request_id, request.slot, position, request.page_ids)
        request.num_output_tokens += 1
        return row

    def _launch_chunks(self, budget: int, beside_decode: bool) -> list[PrefillChunk]:
        """Prompt chunks in FCFS order, within the token budget: up to `max_prefill_chunks` (`chunks_beside_decode`
        beside decode rows), each cut so that the step's padded tokens stay within one full chunk
        (`packed_chunk_cap`), which lets short prompts that arrive together prefill together."""
        config, chunks, longest = self.config, [], 0
        limit = config.chunks_beside_decode if beside_decode else config.max_prefill_chunks
        # Listed before any chunk launches: a request that takes a copy in this step feeds only in a later one,
        # after the copy has run.
        for request in list(self._prompts_to_feed()):
            if budget == 0 or len(chunks) == limit:
                break
            cap = packed_chunk_cap(len(chunks) + 1, config.max_prefill_tokens, config.max_prefill_chunks, beside_decode)
            if cap < longest:  # one more chunk would pad the ones taken past the step's programs
                break
            chunks.append(self._launch_chunk(request, min(request.feedable, budget, cap)))
            budget -= len(chunks[-1].token_ids)
            longest = max(longest, len(chunks[-1].token_ids))
        return chunks

    def _launch_chunk(self, request: Request, length: int) -> PrefillChunk:
        start = request.num_computed_tokens
        end = start + length
        is_last = end == request.num_prompt_tokens
        token_ids = tuple(request.prompt_ids[start:end])
        targets = tuple(request.prompt_ids[start + 1 : end + 1]) if request.prompt_logprobs else ()
        chunk = PrefillChunk(request.request_id, request.slot, start, token_ids, request.page_ids, is_last, targets)
        request.num_computed_tokens = end
        if end == request.fork_point:
            self._copies += self._fork(request)
        if is_last:
            # This step samples the first output token, unless the request only feeds its prompt (max_tokens 0).
            request.num_output_tokens += min(request.max_tokens, 1)
            request.status = RequestStatus.DECODING
        return chunk

    def _fork(self, leader: Request) -> list[StateCopy]:
        """The leader's chunk ends at its fork point: each running request waiting for that prefix gets a copy of
        the caches, after this step, and counts the prefix as fed. Those admitted later prefill themselves."""
        pages = -(-leader.fork_point // self.config.page_size)
        copies = []
        for request in self.running.values():
            if request.fork_of == leader.request_id and request.num_computed_tokens == 0:
                copies.append(StateCopy(request.request_id, leader.slot, request.slot, leader.page_ids[:pages],
                                        request.page_ids[:pages]))  # fmt: skip
                request.num_computed_tokens = leader.fork_point
        leader.fork_point = 0
        return copies

    # ---- introspection -----------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """True while any request is waiting or holds a slot (including those awaiting `finish`)."""
        return bool(self.waiting or self.running)

    def page_usage(self) -> float:
        """Fraction of allocatable KV pages held by requests."""
        return 1.0 - self.page_pool.num_free / self.page_pool.num_total

    def slot_usage(self) -> float:
        """Fraction of allocatable GDN slots held by requests."""
        return 1.0 - self.slot_pool.num_free / self.slot_pool.num_total

    def trace(self, plan: StepPlan) -> str:
        """`trace(plan)` followed by the queue and cache state after the plan was taken."""
        state = f"running={self.num_running} waiting={self.num_waiting}"
        return f"{trace(plan)} {state} kv_use={self.page_usage():.3f} slot_use={self.slot_usage():.3f}"


def step_action(decode: tuple[DecodeRow, ...], prefill: tuple[PrefillChunk, ...]) -> str:
    if decode and prefill:
        return UNIFIED
    if prefill:
        return PREFILL
    return DECODE if decode else IDLE


def overlap_action(action: str, previous: str) -> str:
    """The action of a plan under stream overlap: a unified step is an overlap launch, and a decode step right
    behind one runs while that one is still in flight (the host reads every step back one step late)."""
    if action == UNIFIED:
        return OVERLAP_LAUNCH
    if action == DECODE and previous == OVERLAP_LAUNCH:
        return OVERLAP_DECODE
    return action


def trace(plan: StepPlan) -> str:
    """One `ITL_STEP` log line for a plan; the field names are those of pegainfer's `ITL_STEP` lines, so that
    the step logs of the two engines read alike."""
    return (
        f"ITL_STEP step={plan.step_id} plan={plan.action} decode_n={plan.num_decode_rows} "
        f"prefill_tok={plan.num_prefill_tokens} prefill_reqs={len(plan.prefill)} budget={plan.budget}"
    )
