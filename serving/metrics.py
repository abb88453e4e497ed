"""Prometheus metrics of the server: engine state read at scrape time, and per-request latencies and
token counts recorded as outputs arrive.

Every measure is exposed under this server's own names (`qwen35_jax_*`) and, where vLLM has the same measure,
under vLLM's name too (`vllm:*`, labelled with the served model's name and engine "0", as vLLM's
`PrometheusStatLogger` labels them), so that dashboards and alerts written for vLLM keep working. One observation
feeds both names (`_Both`). vLLM's measures that this engine has no truthful value for (prefix-cache hits: it has
no prefix cache) are left out rather than reported as zeros.

`RequestTimer.record` runs on the engine thread (it is called from `Submission.on_output`); the
prometheus_client metrics it touches are thread-safe. Each `ServingMetrics` has its own registry, so
several servers can live in one process (tests).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from qwen35_jax.serving.engine import RequestOutput

# The `_created` timestamp series double the size of a scrape and no dashboard here uses them.
disable_created_metrics()

PREFIX = "qwen35_jax"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from a millisecond (a fast decode step) to minutes (a long queue wait).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip

# vLLM's label names and buckets (vllm/v1/metrics/loggers.py), so that its dashboards' queries and quantiles read
# the same here. This server runs one engine, so the engine label is always "0".
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE = "0"
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)  # fmt: skip
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
VLLM_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The finish reasons this engine gives; vLLM's request_success_total shows a series for each from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit` (the context length)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _Both:
    """One measure under two names, this server's metric and vLLM's: each observation feeds both."""

    def __init__(self, own, vllm):
        self.own, self.vllm = own, vllm

    def inc(self, amount: float = 1) -> None:
        self.own.inc(amount)
        self.vllm.inc(amount)

    def observe(self, value: float) -> None:
        self.own.observe(value)
        self.vllm.observe(value)


class _EngineCollector(Collector):
    """Queue depth, running requests and pool use, read from the scheduler when scraped.

    The scheduler belongs to the engine thread; these reads are single `len()`s, which are atomic, so a
    scrape sees a state that existed at some moment during the scrape.
    """

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = [model_name, VLLM_ENGINE]

    def collect(self):
        scheduler, runner = self.engine.scheduler, self.engine.runner
        pages, slots = scheduler.page_pool, scheduler.slot_pool
        waiting, running, kv_usage = scheduler.num_waiting, scheduler.num_running, scheduler.page_usage()
        values = [
            ("num_requests_waiting", "Requests queued for admission.", waiting),
            ("num_requests_running", "Requests holding a slot (prefilling or decoding).", running),
            ("kv_cache_usage_ratio", "Fraction of allocatable KV pages held by requests.", kv_usage),
            ("slot_usage_ratio", "Fraction of allocatable GDN state slots held by requests.", scheduler.slot_usage()),
            ("kv_pages_free", "Free KV pages.", pages.num_free),
            ("kv_pages_total", "Allocatable KV pages.", pages.num_total),
            ("slots_free", "Free GDN state slots.", slots.num_free),
            ("slots_total", "Allocatable GDN state slots.", slots.num_total),
            ("programs_built", "Compiled programs ready to run (below programs_total while --background-compile "
             "builds the rest; steps pad up meanwhile).", runner.programs_built()),
            ("programs_total", "Programs of the engine's bucket set: step, row and prompt-logprobs programs.",
             runner.programs_total()),
        ]  # fmt: skip
        for name, documentation, value in values:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", documentation, value=float(value))
        vllm = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage),
        ]
        for name, documentation, value in vllm:
            family = GaugeMetricFamily(name, documentation, labels=VLLM_LABELS)
            family.add_metric(self.labels, float(value))
            yield family


class ServingMetrics:
    """The server's metrics. model_name and max_model_len are the served model's: vLLM's metrics carry the name as
    a label and size their token-count buckets by the context length. With an engine, its state is read at each
    scrape and the tokens of each of its steps are counted (vLLM's iteration tokens)."""

    def __init__(self, model_name: str, max_model_len: int, engine=None):
        self.registry = CollectorRegistry()
        self._vllm_labels = (model_name, VLLM_ENGINE)
        r = self.registry
        self.time_to_first_token = _Both(
            Histogram(f"{PREFIX}_time_to_first_token_seconds", "From submission to the first output token.",
                      buckets=LATENCY_BUCKETS, registry=r),
            self._vllm(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                       buckets=VLLM_TTFT_BUCKETS),
        )  # fmt: skip
        self.inter_token_latency = _Both(
            Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between consecutive output tokens of a request.",
                      buckets=LATENCY_BUCKETS, registry=r),
            self._vllm(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                       buckets=VLLM_TOKEN_GAP_BUCKETS),
        )  # fmt: skip
        self.e2e_latency = _Both(
            Histogram(f"{PREFIX}_e2e_request_latency_seconds", "From submission to the finish of a request.",
                      buckets=LATENCY_BUCKETS, registry=r),
            self._vllm(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                       buckets=VLLM_REQUEST_BUCKETS),
        )  # fmt: skip
        self.prompt_tokens = _Both(
            Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens prefilled, counted when a request's prefill ends.",
                    registry=r),
            self._vllm(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."),
        )  # fmt: skip
        self.generation_tokens = _Both(
            Counter(f"{PREFIX}_generation_tokens", "Output tokens generated.", registry=r),
            self._vllm(Counter, "vllm:generation_tokens", "Number of generation tokens processed."),
        )
        requests_finished = Counter(
            f"{PREFIX}_requests_finished", "Finished requests by finish reason (stop, length, abort, error).",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                  [*VLLM_LABELS, "finished_reason"], registry=r)  # fmt: skip
        self.requests_finished = {
            reason: _Both(requests_finished.labels(finish_reason=reason),
                          request_success.labels(*self._vllm_labels, reason))
            for reason in FINISH_REASONS
        }  # fmt: skip
        self._add_vllm_request_metrics(max_model_len)
        self.http_errors = Counter(
            f"{PREFIX}_http_errors", "Requests answered with an error, by HTTP status.", ["status"], registry=r
        )
        self.requests_active = Gauge(f"{PREFIX}_http_requests_active", "Requests the server is serving.", registry=r)
        self._step_tokens = 0  # the tokens delivered by the step being processed (engine thread)
        if engine is not None:
            r.register(_EngineCollector(engine, model_name))
            engine.after_step_outputs = self.end_step

    def _vllm(self, kind, name: str, documentation: str, **kwargs):
        """A vLLM metric, labelled as vLLM labels it for this server's one engine."""
        return kind(name, documentation, VLLM_LABELS, registry=self.registry, **kwargs).labels(*self._vllm_labels)

    def _add_vllm_request_metrics(self, max_model_len: int) -> None:
        """vLLM's measures that have no qwen35_jax_* name: per-request token counts and phase times, tokens per
        engine step, and preemptions."""
        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = self._vllm(Histogram, "vllm:request_prompt_tokens",
                                                "Number of prefill tokens processed.", buckets=tokens)  # fmt: skip
        self.request_generation_tokens = self._vllm(Histogram, "vllm:request_generation_tokens",
                                                    "Number of generation tokens processed.", buckets=tokens)  # fmt: skip
        self.iteration_tokens = self._vllm(Histogram, "vllm:iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.",
                                           buckets=VLLM_ITERATION_BUCKETS)  # fmt: skip

        def phase(name: str, state: str):
            return self._vllm(Histogram, name, f"Histogram of time spent in {state} phase for request.",
                              buckets=VLLM_REQUEST_BUCKETS)  # fmt: skip

        self.queue_time = phase("vllm:request_queue_time_seconds", "WAITING")
        self.prefill_time = phase("vllm:request_prefill_time_seconds", "PREFILL")
        self.decode_time = phase("vllm:request_decode_time_seconds", "DECODE")
        self.inference_time = phase("vllm:request_inference_time_seconds", "RUNNING")
        self.time_per_output_token = self._vllm(Histogram, "vllm:request_time_per_output_token_seconds",
                                                "Histogram of time_per_output_token_seconds per request.",
                                                buckets=VLLM_TOKEN_GAP_BUCKETS)  # fmt: skip
        # Never incremented, and truthfully so: admission reserves every KV page a request can need
        # (scheduler.py), so a running request is never preempted.
        self._vllm(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def count_step_tokens(self, num_tokens: int) -> None:
        """Engine thread: tokens that an output of the step being processed delivered."""
        self._step_tokens += num_tokens

    def end_step(self) -> None:
        """Engine thread, once a step's outputs are all delivered: vLLM's iteration tokens of the step, the prompt
        tokens of the requests whose prefill it ended plus the tokens it generated."""
        if self._step_tokens:
            self.iteration_tokens.observe(self._step_tokens)
            self._step_tokens = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's clock and counts, fed with each of its outputs: its prompt tokens once its prefill ends, TTFT
    on its first token, ITL between tokens, and at the finish E2E, its token counts and, from the engine's
    timestamps, vLLM's phase times (queue: queued to first scheduled; prefill: scheduled to first token; decode:
    first to last token; inference: scheduled to last token)."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics
        self.submitted_at = time.perf_counter()
        self.prefilled = False
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_tokens = 0

    def record(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        # The first output with tokens ends the prefill; so does a `length` finish without any (max_tokens 0).
        if not self.prefilled and (output.token_ids or output.finish_reason == "length"):
            self.prefilled = True
            self.metrics.prompt_tokens.inc(output.num_prompt_tokens)
            self.metrics.count_step_tokens(output.num_prompt_tokens)
        if output.token_ids:
            self._tokens(len(output.token_ids), now)
        if output.finish_reason is not None:
            self._finished(output, now)

    def _tokens(self, num_tokens: int, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(num_tokens)
        m.count_step_tokens(num_tokens)
        self.num_tokens += num_tokens
        if self.last_token_at is None:
            m.time_to_first_token.observe(now - self.submitted_at)
            num_tokens -= 1
            self.first_token_at = self.last_token_at = now
        if num_tokens:
            gap = (now - self.last_token_at) / num_tokens
            for _ in range(num_tokens):
                m.inter_token_latency.observe(gap)
            self.last_token_at = now

    def _finished(self, output: RequestOutput, now: float) -> None:
        m = self.metrics
        m.e2e_latency.observe(now - self.submitted_at)
        m.requests_finished[output.finish_reason].inc()
        m.request_prompt_tokens.observe(output.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        if output.scheduled_at is None:  # finished while queued: it has no phases but its wait, which never ended
            return
        m.queue_time.observe(output.scheduled_at - output.queued_at)
        if self.first_token_at is None:  # ended before its prefill did
            return
        decode = self.last_token_at - self.first_token_at
        m.prefill_time.observe(self.first_token_at - output.scheduled_at)
        m.decode_time.observe(decode)
        m.inference_time.observe(self.last_token_at - output.scheduled_at)
        m.time_per_output_token.observe(decode / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0)
