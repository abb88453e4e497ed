"""The engine loop: schedule -> launch -> process the previous step's result, one step late.

The host never waits on the step it just launched: it reads step N-1's tokens after launching step N, so
the device always has the next step queued. Requests are retired on EOS, stop token ids, stop strings or
length; retiring, cancelling and failing all hand the request's slot and pages back at once. That is safe
while a step that uses them is still in flight: every step takes the caches from the step before
(donated buffers, one compute stream), so a later owner's writes are ordered after it.

Threading: `submit` and `abort` may be called from any thread; the loop runs in one thread (`start`) or
inline (`run_until_done`). Outputs are delivered through each request's `on_output` callback.

A request is two objects here: its `Generation` (this module: what the engine needs to turn sampled tokens
into outputs) and the scheduler's `Request` (plan.py: prompt, slot, pages and launch-time counters).

A request under a grammar (`response_format`, structured_output.py) is the exception to one step late: its next
token's mask depends on the token just sampled, so it gets its next row only once the host has read that
token (`Scheduler.token_read`) and advanced its `GrammarState`. So does one with a bad word of several tokens
(token_filter.py). Other requests' rows are launched as before.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from qwen35_jax.sampling import SamplingParams
from qwen35_jax.serving.plan import OVERLAP_COMPLETE, OVERLAP_LAUNCH, OVERLAP_WAIT, Request, StepPlan
from qwen35_jax.serving.runner import StepHandle
from qwen35_jax.serving.scheduler import RequestRejected, Scheduler, step_action
from qwen35_jax.tokenizer import IncrementalDetokenizer, StopStringMatcher

if TYPE_CHECKING:  # the engine runs grammars it is given; only the HTTP side compiles them (and imports llguidance)
    from qwen35_jax.serving.structured_output import Grammar, GrammarState
    from qwen35_jax.serving.token_filter import TokenFilter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """What one request asks for besides its prompt; built on the HTTP side (prompts.py), never changed."""

    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per token; None = none
    # top-N logprobs at each prompt token after the first (beside the token's own); None = none. The prompt's
    # chunks then run in prompt-logprobs steps, and the first output delivered carries them all.
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None  # response_format's compiled grammar: the output must follow it
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string that ended it
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text
    # vLLM's: the first min_tokens output tokens are never an end of sequence or a stop token (their logits are
    # pushed to -inf), and no stop string is looked for in their text.
    min_tokens: int = 0
    # vLLM's allowed_token_ids and bad_words (token_filter.py): the tokens sampling may pick
    token_filter: TokenFilter | None = None

    @property
    def waits_for_tokens(self) -> bool:
        """The next token's mask depends on the last one sampled (a grammar, or a bad word of several tokens)."""
        return self.grammar is not None or (self.token_filter is not None and self.token_filter.waits_for_tokens)

    def held_back(self, eos_token_ids) -> tuple[int, ...]:
        """The tokens min_tokens keeps out of the first outputs."""
        return tuple(dict.fromkeys((*self.stop_token_ids, *(() if self.ignore_eos else eos_token_ids))))


@dataclasses.dataclass
class TokenLogprob:
    """One token's logprob and the top-N alternatives (most likely first), as the device returned them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # of a prompt token: 1 + the tokens the model found likelier there


@dataclasses.dataclass
class RequestOutput:
    """One delivery to a request's consumer: new tokens since the last one, and the finish if it happened.

    Made on the engine thread and handed to `Generation.on_output`. The output that ends a request carries
    no tokens, only `finish_reason` (and `error`)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    error: str | None = None
    # The request parameter that caused the error, when the request rather than the engine is at fault (a
    # response_format grammar that dead-ends): the server then answers a 400 naming it, not a 500.
    error_param: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # With GenerationParams.prompt_logprobs, on the request's first output: one entry per prompt token from the
    # second on (the first has no context to be scored in).
    prompt_logprobs: list[TokenLogprob] | None = None
    # On the finishing output, vLLM's stop_reason: the stop string that ended the output, or the stop token id
    # (from stop_token_ids); None when an end of sequence, a complete grammar or the length limit ended it.
    stop_reason: int | str | None = None
    # On the finishing output, the engine's clock (time.perf_counter) when the scheduler was handed the request
    # and when a step first scheduled it (None: it never left the queue), for vLLM's queue and prefill times.
    queued_at: float | None = None
    scheduled_at: float | None = None


@dataclasses.dataclass(eq=False)
class Generation:
    """The engine's bookkeeping of one request, from `submit` to its finish; owned by the engine thread.

    The scheduler's `Request` is the part that scheduling reads and moves, its counters advancing when a
    step is launched. This holds the rest, which only the engine needs: the params, the consumer's
    callback, the text tools, and the output tokens as they are read back, one step late (so
    `len(output_ids)` trails `request.num_output_tokens`). It lives in `Engine.generations` until
    `_finish` pops it; a token that arrives after that is dropped. On the HTTP side the consumer behind
    `on_output` is a `Submission` (submission.py).
    """

    request: Request
    params: GenerationParams
    on_output: Callable[[RequestOutput], None]
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer: outputs carry token ids only
    stop_matcher: StopStringMatcher | None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # gathered chunk by chunk
    prompt_logprobs_sent: bool = False
    grammar: GrammarState | None = None  # where the output stands in its grammar, advanced as tokens are read
    # The sampling row of every step, for a request whose row never changes (`fixed_sampling_row`); None: built
    # each step.
    fixed_row: SamplingRow | None = None
    queued_at: float | None = None  # when the scheduler was handed it (time.perf_counter)
    scheduled_at: float | None = None  # when a step first scheduled its prompt (a chunk, or a copy of its prefix)


@dataclasses.dataclass
class SamplingRow:
    """Per-row sampling inputs as the runner wants them."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    output_index: int
    # None: no logprobs; 0: the token's own; N: also the top N (the runner computes the top ones only for steps
    # where a row wants some, and brings the token's own to the host only for steps where a row wants it)
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    token_mask: np.ndarray | None = None  # [ceil(vocab / 32)] int32: the tokens a grammar allows (None: all)

    @property
    def needs_sampler(self) -> bool:
        """The step's greedy pick is not this row's token: it samples, or something moves its argmax."""
        return bool(self.temperature > 0 or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or self.token_mask is not None)  # fmt: skip


def fixed_sampling_row(params: GenerationParams) -> SamplingRow | None:
    """The one sampling row of a greedy request without a mask, penalties or min_tokens: its output index would key
    only random draws and penalty counts, which it has neither of, so nothing in its row moves from step to step.
    None for the others."""
    s = params.sampling
    if (s.temperature > 0 or params.grammar is not None or params.token_filter is not None or params.min_tokens
            or s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1):  # fmt: skip
        return None
    return SamplingRow(s.temperature, s.top_k, s.top_p, s.min_p, s.seed, 0, params.logprobs, s.logit_bias,
                       s.presence_penalty, s.frequency_penalty, s.repetition_penalty)  # fmt: skip


class Engine:
    """The loop over one runner and one scheduler: schedule, launch, then process the previous step's tokens."""

    def __init__(self, runner, scheduler: Scheduler, tokenizer, eos_token_ids: tuple[int, ...]):
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generations: dict[str, Generation] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Generation] = []
        self._aborts: list[str] = []
        self._in_flight: StepHandle | None = None
        # A prefill-only step launched by an idle engine: a burst's first prompt, or a lone request. The next step is
        # planned once it is done rather than while it runs, so that the prompts arriving meanwhile (the rest of the
        # burst, ~20 ms of a 4B prefill) join that step instead of the one after it, whose plan was made the moment
        # the first step launched. Later steps are planned one ahead as usual.
        self._from_idle: StepHandle | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.trace_steps = False
        # Warm programs built in the background up while idle (`Runner.warm_up`): set by build_engine on a GPU.
        self.warm_up_idle = False
        # Called on the engine thread once a step's outputs have all been delivered (the metrics close the step's
        # token count there); None: nothing to call.
        self.after_step_outputs: Callable[[], None] | None = None

    # ---- requests --------------------------------------------------------------------------------------
    def check(self, num_prompt_tokens: int, max_tokens: int, prompt_logprobs: bool = False) -> None:
        """Raises RequestRejected when the request can never fit, or asks for prompt logprobs from an engine built
        without their programs (before anything is queued)."""
        self.scheduler.check_request(num_prompt_tokens, max_tokens, prompt_logprobs)

    def submit(self, prompt_ids: list[int], params: GenerationParams, on_output, request_id: str | None = None,
               fork_of: str | None = None) -> str:  # fmt: skip
        """Queues a request; returns its id. fork_of: the id of a request submitted before it with the same prompt
        (another sample of it): this one then takes a copy of that one's prefilled prompt instead of prefilling
        it again (`Request.fork_of`), where the scheduler can."""
        scored = params.prompt_logprobs is not None
        self.check(len(prompt_ids), params.max_tokens, scored)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id=request_id, prompt_ids=list(prompt_ids), max_tokens=params.max_tokens,
                          prompt_logprobs=scored, waits_for_tokens=params.waits_for_tokens,
                          fork_of=fork_of)  # fmt: skip
        grammar = None if params.grammar is None else params.grammar.start()
        gen = Generation(request, params, on_output, *self._text_tools(params), grammar=grammar,
                         fixed_row=fixed_sampling_row(params))  # fmt: skip
        with self._wake:
            # A live duplicate would make the loop's scheduler.add raise, which would stop the engine.
            if request_id in self.generations or any(g.request.request_id == request_id for g in self._inbox):
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._inbox.append(gen)
            self._wake.notify()
        return request_id

    def _text_tools(self, params: GenerationParams):
        if self.tokenizer is None:
            return None, None
        matcher = StopStringMatcher(params.stop, include=params.include_stop_str_in_output) if params.stop else None
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens), matcher

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    # ---- the loop -------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            # Under the lock, so that `submit` always sees a submitted id in the inbox or in `generations`.
            for gen in inbox:
                self.generations[gen.request.request_id] = gen
        now = time.perf_counter()
        for gen in inbox:
            gen.queued_at = now
            self.scheduler.add(gen.request)
        for request_id in aborts:
            self._finish(request_id, "abort", emit=True)

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do."""
        waited = self._in_flight is not None and self._in_flight is self._from_idle
        if waited:  # see _from_idle
            handle, self._in_flight = self._in_flight, None
            self._process(handle)
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if not plan.decode and self._in_flight is not None and self._in_flight.plan.action == OVERLAP_LAUNCH:
            self._wait_for_overlap()
            plan = self._without_retired(plan)
        self._note_scheduled(plan)
        launched = self._launch(plan) if plan.action != "idle" else None
        previous, self._in_flight = self._in_flight, launched
        self._from_idle = launched if previous is None and not waited and not plan.decode else None
        if previous is not None:
            self._process(previous)
        return launched is not None or previous is not None or waited

    def _wait_for_overlap(self) -> None:
        """The last decoder retired while an overlapped step is in flight: block on that step explicitly, and
        deliver its chunk, before the prefill-only steps that follow (pegainfer's `overlap_wait`)."""
        handle, self._in_flight = self._in_flight, None
        self._trace(f"ITL_STEP step={handle.plan.step_id} plan={OVERLAP_WAIT}")
        self._process(handle)

    def _without_retired(self, plan: StepPlan) -> StepPlan:
        """The plan less the chunks of requests retired since it was scheduled: a failed step, processed by the
        wait, fails its requests, and a prompt it carried has its next chunk in this plan."""
        prefill = tuple(chunk for chunk in plan.prefill if chunk.request_id in self.generations)
        if len(prefill) == len(plan.prefill):
            return plan
        # A sample whose prefix copy came from a dropped chunk has counted that prefix as fed: it fails too.
        copies = []
        for copy in plan.copies:
            gen = self.generations.get(copy.request_id)
            if gen is not None and gen.request.fork_of not in self.generations:
                self._finish(copy.request_id, "error", emit=True,
                             error="the request whose prompt prefill this one shared failed")  # fmt: skip
            elif gen is not None:
                copies.append(copy)
        return dataclasses.replace(plan, prefill=prefill, action=step_action(plan.decode, prefill),
                                   prompt_logprobs=plan.prompt_logprobs and bool(prefill),
                                   copies=tuple(copies))  # fmt: skip

    def _note_scheduled(self, plan: StepPlan) -> None:
        """Stamps the requests that this plan schedules for the first time, by a chunk of their prompt or a copy of
        its prefix: their wait in the queue ends here (vLLM's SCHEDULED event). Decode rows need no look: a request
        decodes only after its prompt was scheduled."""
        now = None
        for row in itertools.chain(plan.prefill, plan.copies):
            gen = self.generations.get(row.request_id)
            if gen is not None and gen.scheduled_at is None:
                now = now or time.perf_counter()
                gen.scheduled_at = now

    def _trace(self, line: str) -> None:
        if self.trace_steps:
            log.info(line)

    def _sampling_rows(self, plan: StepPlan) -> list[SamplingRow]:
        rows = []
        for row in itertools.chain(plan.decode, plan.prefill):
            gen = self.generations[row.request_id]
            if gen.fixed_row is not None:
                rows.append(gen.fixed_row)
                continue
            s = gen.params.sampling
            index = gen.request.num_output_tokens - 1  # counted at schedule time for this step
            samples = getattr(row, "is_last", True)  # a chunk before the prompt's last samples nothing
            mask = gen.grammar.mask if gen.grammar is not None and samples else None
            if gen.params.token_filter is not None and samples:
                mask = gen.params.token_filter.mask(gen.output_ids, mask)
            bias = s.logit_bias
            if samples and index < gen.params.min_tokens:
                bias += tuple((token, -np.inf) for token in gen.params.held_back(self.eos_token_ids))
            rows.append(SamplingRow(s.temperature, s.top_k, s.top_p, s.min_p, s.seed, index, gen.params.logprobs,
                                    bias, s.presence_penalty, s.frequency_penalty,
                                    s.repetition_penalty, mask))  # fmt: skip
        return rows

    def _launch(self, plan: StepPlan) -> StepHandle | None:
        if self.trace_steps:
            self._trace(self.scheduler.trace(plan))
        try:
            return self.runner.launch(plan, self._sampling_rows(plan))
        except Exception as err:  # a failed step fails its requests, not the engine
            log.exception("step %d failed", plan.step_id)
            self._fail_step(plan, f"engine step failed: {err}")
            return None

    def _fail_step(self, plan: StepPlan, message: str) -> None:
        # A request that takes a prefix copy from this step has counted the prefix as fed: it fails with the step.
        ids = {r.request_id for r in itertools.chain(plan.decode, plan.prefill, plan.copies)}
        if self.runner.cache_lost():
            ids |= {rid for rid, gen in self.generations.items() if gen.request.slot is not None}
            self.runner.reset_cache()
            self._in_flight = None
        for request_id in ids:
            self._finish(request_id, "error", emit=True, error=message)

    def _process(self, handle: StepHandle) -> None:
        try:
            tokens, chosen, top_ids, top_lp = handle.fetch()
            prompt_outputs = handle.fetch_prompt_logprobs()
        except Exception as err:
            log.exception("step %d failed on the device", handle.plan.step_id)
            self._fail_step(handle.plan, f"engine step failed: {err}")
            return
        if handle.plan.action == OVERLAP_LAUNCH:
            self._trace(f"ITL_STEP step={handle.plan.step_id} plan={OVERLAP_COMPLETE} "
                        f"prefill_tok={handle.plan.num_prefill_tokens}")  # fmt: skip
        if handle.plan.prompt_logprobs:
            self._gather_prompt_logprobs(handle.plan.prefill[0], *prompt_outputs)
        for i, row in handle.output_rows():
            if getattr(row, "is_last", True):
                top = (None, None) if top_ids is None else (top_ids[i], top_lp[i])
                logprob = None if chosen is None else float(chosen[i])  # None: no row of the step wants it
                self._accept(row.request_id, int(tokens[i]), logprob, *top)
        if self.after_step_outputs is not None:
            self.after_step_outputs()

    def _gather_prompt_logprobs(self, chunk, logprobs, ranks, top_ids, top_lp) -> None:
        """A prompt-logprobs step's results: position j of the chunk scored prompt token `chunk.targets[j]`."""
        gen = self.generations.get(chunk.request_id)
        if gen is None:
            return  # retired while this step was in flight
        n = gen.params.prompt_logprobs
        for j, token in enumerate(chunk.targets):
            top = [(int(i), float(v)) for i, v in zip(top_ids[j, :n], top_lp[j, :n], strict=True)]
            gen.prompt_logprobs.append(TokenLogprob(token, float(logprobs[j]), top, int(ranks[j])))

    def _accept(self, request_id: str, token: int, logprob: float | None, top_ids, top_lp) -> None:
        gen = self.generations.get(request_id)
        if gen is None:
            return  # retired while this step was in flight
        if gen.params.max_tokens == 0:  # the prompt alone was asked for: the token its last chunk picked is no output
            self._finish(request_id, "length", emit=True)
            return
        gen.output_ids.append(token)
        if gen.request.waits_for_tokens:
            self.scheduler.token_read(request_id)
        if gen.grammar is not None and not self._advance_grammar(gen, token):
            return
        reason = self._finish_reason(gen, token)
        text, stopped = self._text_delta(gen, token, reason)
        lps = None
        if gen.params.logprobs is not None:
            n = gen.params.logprobs
            top = [] if not n else [(int(i), float(v)) for i, v in zip(top_ids[:n], top_lp[:n], strict=True)]
            lps = [TokenLogprob(token, logprob, top)]
        self._emit(gen, RequestOutput(request_id, [token], text, lps))
        if stopped or reason is not None:
            self._finish(request_id, "stop" if stopped else reason, emit=True,
                         stop_reason=self._stop_reason(gen, token, stopped))  # fmt: skip

    def _advance_grammar(self, gen: Generation, token: int) -> bool:
        """Moves the request's grammar past its token; False (and the request failed) when the grammar refused the
        token or ran out of its limits."""
        request_id = gen.request.request_id
        if gen.grammar.accept(token):
            return True
        message = f"the {gen.grammar.param} grammar failed at output token {len(gen.output_ids)}: {gen.grammar.error}"
        log.error("%s: %s", request_id, message)
        self._finish(request_id, "error", emit=True, error=message, error_param=gen.grammar.param)
        return False

    def _is_stop_token(self, gen: Generation, token: int) -> bool:
        return token in gen.params.stop_token_ids or (not gen.params.ignore_eos and token in self.eos_token_ids)

    def _stop_reason(self, gen: Generation, token: int, stopped: bool) -> int | str | None:
        """vLLM's stop_reason of an output that just ended: the stop string found in its text, else its last token
        when that is one of the request's stop_token_ids and not an end of sequence it obeys (vLLM checks EOS
        first); None otherwise (EOS, a complete grammar, the length limit)."""
        if stopped:
            return gen.stop_matcher.matched
        obeyed_eos = not gen.params.ignore_eos and token in self.eos_token_ids
        return token if token in gen.params.stop_token_ids and not obeyed_eos else None

    def _finish_reason(self, gen: Generation, token: int) -> str | None:
        # A complete grammar takes no more tokens: its last one ends the output, as a stop string would.
        if self._is_stop_token(gen, token) or (gen.grammar is not None and gen.grammar.finished):
            return "stop"
        if len(gen.output_ids) >= gen.params.max_tokens:
            return "length"
        return None

    def _text_delta(self, gen: Generation, token: int, reason: str | None) -> tuple[str, bool]:
        """New text for this token (a stop token adds none) and whether a stop string ended the output."""
        if gen.detokenizer is None:
            return "", False
        text = "" if self._is_stop_token(gen, token) else gen.detokenizer.push(token)
        if reason is not None:
            text += gen.detokenizer.flush()
        if gen.stop_matcher is None or len(gen.output_ids) <= gen.params.min_tokens:
            return text, False
        text, stopped = gen.stop_matcher.push(text)
        if reason is not None and not stopped:
            text += gen.stop_matcher.flush()
        return text, stopped

    def _emit(self, gen: Generation, output: RequestOutput) -> None:
        output.num_prompt_tokens = gen.request.num_prompt_tokens
        output.num_output_tokens = len(gen.output_ids)
        if gen.params.prompt_logprobs is not None and not gen.prompt_logprobs_sent:
            output.prompt_logprobs, gen.prompt_logprobs_sent = gen.prompt_logprobs, True
        try:
            gen.on_output(output)
        except Exception:  # a consumer's failure must not stop the engine
            log.exception("on_output for %s failed", gen.request.request_id)

    def _finish(self, request_id: str, reason: str, emit: bool, error: str | None = None,
                error_param: str | None = None, stop_reason: int | str | None = None) -> None:  # fmt: skip
        gen = self.generations.pop(request_id, None)
        if gen is None:
            return
        if reason in ("abort", "error"):
            self.scheduler.abort(request_id)
        else:
            self.scheduler.finish(request_id, reason)
        if emit:
            self._emit(gen, RequestOutput(request_id, [], "", None, finish_reason=reason, error=error,
                                          error_param=error_param, stop_reason=stop_reason, queued_at=gen.queued_at,
                                          scheduled_at=gen.scheduled_at))  # fmt: skip

    # ---- running ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return pending or self.scheduler.has_work() or self._in_flight is not None

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        """True while the loop thread started by `start` is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and self._idle():
                    if self.warm_up_idle and self.runner.unwarmed():
                        break
                    # While programs are built in the background, look again for new ones to warm up.
                    self._wake.wait(timeout=1.0 if self.warm_up_idle and self.runner.building else None)
                if self._stopping:
                    break
                idle = self._idle()
            try:
                if idle:  # a program built in the background: its first run now, not in a request's step
                    self.runner.warm_up(self.runner.unwarmed()[:1])
                else:
                    self.step()
            except Exception as err:  # a host-side bug must not end the loop and strand every client
                log.exception("engine step raised outside a device step")
                self._fail_everything(f"engine error: {err}")
        self._drain_in_flight()

    def _fail_everything(self, message: str) -> None:
        """Fail every live request and start from fresh caches: the engine's state can no longer be trusted."""
        self._in_flight = None
        self.runner.reset_cache()
        for request_id in list(self.generations):
            self._finish(request_id, "error", emit=True, error=message)

    def _busy(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def _idle(self) -> bool:
        """Nothing to step: no new request or abort, no scheduled work, no step in flight (hold `_wake`)."""
        return not (self._inbox or self._aborts) and not self._busy()

    def _drain_in_flight(self) -> None:
        if self._in_flight is not None:
            handle, self._in_flight = self._in_flight, None
            self._process(handle)

    def shutdown(self) -> None:
        """Stop the loop; the step in flight is drained (waited for and delivered) first."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        # The build stops after the program it is compiling; its thread is a daemon, so a long compile does not
        # hold shutdown up.
        self.runner.stop_background(timeout=10.0)
        self._drain_inbox()  # requests submitted but never picked up must be ended too, or their consumers hang
        for request_id in list(self.generations):
            self._finish(request_id, "abort", emit=True, error="engine shut down")
