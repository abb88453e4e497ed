"""Prometheus metrics of the server: engine state read at scrape time, and per-request latencies and
token counts recorded as outputs arrive.

`RequestTimer.record` runs on the engine thread (it is called from `Submission.on_output`); the
prometheus_client metrics it touches are thread-safe. Each `ServingMetrics` has its own registry, so
several servers can live in one process (tests).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# The `_created` timestamp series double the size of a scrape and no dashboard here uses them.
disable_created_metrics()

PREFIX = "qwen35_jax"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from a millisecond (a fast decode step) to minutes (a long queue wait).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip


class _EngineCollector(Collector):
    """Queue depth, running requests and pool use, read from the scheduler when scraped.

    The scheduler belongs to the engine thread; these reads are single `len()`s, which are atomic, so a
    scrape sees a state that existed at some moment during the scrape.
    """

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        scheduler, runner = self.engine.scheduler, self.engine.runner
        pages, slots = scheduler.page_pool, scheduler.slot_pool
        values = [
            ("num_requests_waiting", "Requests queued for admission.", scheduler.num_waiting),
            ("num_requests_running", "Requests holding a slot (prefilling or decoding).", scheduler.num_running),
            ("kv_cache_usage_ratio", "Fraction of allocatable KV pages held by requests.", scheduler.page_usage()),
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


class ServingMetrics:
    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "From submission to the first output token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Between consecutive output tokens of a request.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "From submission to the finish of a request.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of submitted requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Output tokens generated.", registry=r)
        self.requests_finished = Counter(
            f"{PREFIX}_requests_finished", "Finished requests by finish reason (stop, length, abort, error).",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.http_errors = Counter(
            f"{PREFIX}_http_errors", "Requests answered with an error, by HTTP status.", ["status"], registry=r
        )
        self.requests_active = Gauge(f"{PREFIX}_http_requests_active", "Requests the server is serving.", registry=r)
        if engine is not None:
            r.register(_EngineCollector(engine))

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's clock: TTFT on its first token, ITL between tokens, E2E and the counters at the finish."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics
        self.submitted_at = time.perf_counter()
        self.last_token_at: float | None = None

    def record(self, num_tokens: int, finish_reason: str | None) -> None:
        now = time.perf_counter()
        m = self.metrics
        if num_tokens:
            m.generation_tokens.inc(num_tokens)
            if self.last_token_at is None:
                m.time_to_first_token.observe(now - self.submitted_at)
                num_tokens -= 1
                self.last_token_at = now
            if num_tokens:
                gap = (now - self.last_token_at) / num_tokens
                for _ in range(num_tokens):
                    m.inter_token_latency.observe(gap)
                self.last_token_at = now
        if finish_reason is not None:
            m.e2e_latency.observe(now - self.submitted_at)
            m.requests_finished.labels(finish_reason=finish_reason).inc()
