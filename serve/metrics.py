"""Prometheus metrics (``/metrics``), named like vLLM's with an ``autodeploy_`` prefix.

Request-level metrics (TTFT, inter-token latency, end-to-end latency, queue time, token and
request counters) are observed from the engine's outputs as they are produced. Engine-level
gauges (running and waiting requests, KV usage, prefix-cache hit rate, preemptions) are read from
an engine stats snapshot at scrape time, so they are never stale. Each server has its own registry.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import EngineStats
from .outputs import RequestOutput

PREFIX = "autodeploy_"
# bucket lists as vLLM and TensorRT-LLM use them, so dashboards port over
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """All metrics of one served model; :meth:`observe` is called with every batch of outputs."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time from arrival to first scheduling", LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(model_name)
        self._success = counter("request_success", "Requests finished, by reason", ("finished_reason",))
        self._failure = counter("request_failure", "Requests rejected or failed, by HTTP status", ("status",))
        self.registry.register(_EngineCollector(model_name, stats))
        self._last_token_time: dict[tuple[str, int], float] = {}
        self._started: set[str] = set()

    def observe(self, outputs: Iterable[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            if out.error is not None:
                self.record_failure(500)
                self._forget(out.request_id)
                continue
            self._observe_tokens(out, now)
            if out.finished:
                self._observe_finished(out)

    def record_failure(self, status: int) -> None:
        self._failure.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _observe_tokens(self, out: RequestOutput, now: float) -> None:
        new_tokens = 0
        for choice in out.outputs:
            n = len(choice.token_ids)
            if n == 0:
                continue
            new_tokens += n
            key = (out.request_id, choice.index)
            last = self._last_token_time.get(key)
            if last is not None:
                for _ in range(n):  # tokens of one report arrived together: spread the gap
                    self.itl.observe((now - last) / n)
            self._last_token_time[key] = now
        if new_tokens and out.request_id not in self._started:
            self._started.add(out.request_id)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.metrics and out.metrics.first_token_time:
                self.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
        self.generation_tokens.inc(new_tokens)

    def _observe_finished(self, out: RequestOutput) -> None:
        reasons = {c.finish_reason for c in out.outputs if c.finish_reason}
        self._success.labels(self.model_name, "abort" if "abort" in reasons else (sorted(reasons) or ["stop"])[0]).inc()
        m = out.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self._forget(out.request_id)

    def _forget(self, request_id: str) -> None:
        self._started.discard(request_id)
        for key in [k for k in self._last_token_time if k[0] == request_id]:
            del self._last_token_time[key]


class _EngineCollector:
    """Gauges and totals read from the engine at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        stats = self.stats()
        if stats is None:  # still loading
            return
        values = {
            "num_requests_running": ("Sequences running (n per request with n choices)", stats.num_running),
            "num_requests_waiting": ("Sequences waiting (n per request with n choices)", stats.num_waiting),
            "kv_cache_usage_perc": ("Share of KV blocks in use (0-1)", stats.kv_usage),
            "kv_cache_used_blocks": ("KV blocks in use", stats.num_used_blocks),
            "kv_cache_max_blocks": ("KV blocks in the pool", stats.num_blocks),
            "prefix_cache_hit_rate": ("Prefix-cache hits / queries (tokens)", stats.prefix_cache_hit_rate),
        }
        for name, (doc, value) in values.items():
            yield _gauge(PREFIX + name, doc, self.model_name, value)
        totals = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
            "num_preemptions": ("Sequences preempted (to be recomputed)", stats.num_preemptions),
        }
        for name, (doc, value) in totals.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        compiles = CounterMetricFamily(PREFIX + "compiles_after_ready", "Triton compiles, torch.compile compiles, "
                                       "CUDA-graph captures and GEMM timings after the server said ready (a request "
                                       "waited for each)", labels=["model_name", "kind"])
        for kind, count in stats.compiles_after_ready.items():
            compiles.add_metric([self.model_name, kind], count)
        yield compiles


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family
