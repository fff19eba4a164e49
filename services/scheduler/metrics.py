"""The scheduler's Prometheus metrics (routing decisions by reason, prefix hits, index lookups), the engine
series of its live workers (from their heartbeats), and the tiny aiohttp server that exposes them at /metrics."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

import prometheus_client as prom
import prometheus_client.utils
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from services.scheduler.policy import Decision
from shared.loop_lag import LoopLag, LoopLagCollector
from shared.messages import EngineMetrics, HistogramCounts

WorkerMetrics = Callable[[], list[tuple[str, EngineMetrics]]]  # (worker_id, its latest EngineMetrics) per live worker

_GAUGES: list[tuple[str, str, Callable[[EngineMetrics], float]]] = [
    ("radixserve_num_requests_running", "sequences running in the worker's engine", lambda m: m.num_requests_running),
    ("radixserve_num_requests_waiting", "sequences in the engine's own waiting queue",
     lambda m: m.num_requests_waiting),
    ("radixserve_kv_cache_usage_perc", "fraction of KV pages held by requests, 0..1 (evictable cached pages count as "
     "free)", lambda m: m.num_request_pages / m.num_total_pages if m.num_total_pages else 0.0),
    ("radixserve_prefix_cache_usage_perc", "fraction of KV pages held by the radix prefix cache, 0..1",
     lambda m: m.num_cached_pages / m.num_total_pages if m.num_total_pages else 0.0),
]
_COUNTERS: list[tuple[str, str, Callable[[EngineMetrics], float]]] = [
    ("radixserve_num_preemptions", "sequences preempted (their KV recomputed later)", lambda m: m.num_preemptions),
    ("radixserve_prefix_cache_queries", "prompt tokens looked up in the prefix cache at first admission",
     lambda m: m.num_prefix_queries),
    ("radixserve_prefix_cache_hits", "prompt tokens the prefix cache served at first admission",
     lambda m: m.num_prefix_hits),
    ("radixserve_prompt_tokens", "prompt tokens of sequences admitted", lambda m: m.num_prompt_tokens),
    ("radixserve_generation_tokens", "tokens generated", lambda m: m.num_generation_tokens),
    ("radixserve_spec_decode_num_drafts", "speculative decoding: sequence-steps that verified draft tokens",
     lambda m: m.num_spec_drafts),
    ("radixserve_spec_decode_num_draft_tokens", "speculative decoding: draft tokens verified",
     lambda m: m.num_spec_draft_tokens),
    ("radixserve_spec_decode_num_accepted_tokens", "speculative decoding: draft tokens the target accepted",
     lambda m: m.num_spec_accepted_tokens),
]
_HISTOGRAMS: list[tuple[str, str, Callable[[EngineMetrics], HistogramCounts]]] = [
    ("radixserve_request_queue_time_seconds", "request arrival (tokenizer) to its first engine step",
     lambda m: m.queue_time_s),
    ("radixserve_engine_step_seconds", "wall time of one engine step", lambda m: m.step_time_s),
    ("radixserve_iteration_tokens_total", "tokens per engine step", lambda m: m.step_tokens),
    ("radixserve_engine_step_sequences", "sequences per engine step (batch size)", lambda m: m.step_sequences),
]


class EngineMetricsCollector:
    """Renders each live worker's latest EngineMetrics as Prometheus families, labelled worker_id."""

    def __init__(self, read: WorkerMetrics) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        workers = self._read()
        for name, help_text, value in _GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["worker_id"])
            for worker_id, metrics in workers:
                family.add_metric([worker_id], value(metrics))
            yield family
        for name, help_text, value in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["worker_id"])
            for worker_id, metrics in workers:
                family.add_metric([worker_id], value(metrics))
            yield family
        for name, help_text, histogram in _HISTOGRAMS:
            family = HistogramMetricFamily(name, help_text, labels=["worker_id"])
            for worker_id, metrics in workers:
                family.add_metric([worker_id], *_buckets(histogram(metrics)))
            yield family


def _buckets(histogram: HistogramCounts) -> tuple[list[tuple[str, float]], float]:
    """Per-bucket counts → Prometheus' cumulative (le, count) pairs ending with +Inf, and the sum."""
    bounds = [prom.utils.floatToGoString(b) for b in histogram.bounds] + ["+Inf"]
    return list(zip(bounds, accumulate(histogram.counts))), histogram.sum


class _CounterFunction:
    def __init__(self, name: str, help_text: str, label: str, read: Callable[[], dict[str, float]]) -> None:
        self._name, self._help, self._label, self._read = name, help_text, label, read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._help, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


class SchedulerMetrics:
    """One registry per scheduler process (not the global default, so tests can build several)."""

    def __init__(self, policy: str, workers: WorkerMetrics = list, loop_lag: LoopLag | None = None) -> None:
        self.policy = policy
        self.registry = prom.CollectorRegistry()
        self.registry.register(EngineMetricsCollector(workers))
        self.registry.register(LoopLagCollector("radixserve_scheduler", loop_lag or LoopLag()))
        self.decisions = prom.Counter("radixserve_scheduler_routing_decisions", "requests routed, by reason",
                                      ["policy", "reason"], registry=self.registry)
        self.prompt_blocks = prom.Counter("radixserve_scheduler_prompt_blocks",
                                          "full prompt blocks of routed requests", registry=self.registry)
        self.cache_hit_blocks = prom.Counter(
            "radixserve_scheduler_cache_hit_blocks",
            "prompt blocks the chosen worker already held (global index or pending entries)", registry=self.registry)
        self.lookup_errors = prom.Counter("radixserve_scheduler_prefix_lookup_errors",
                                          "global index lookups that failed or timed out", registry=self.registry)
        self.lookup_seconds = prom.Histogram(
            "radixserve_scheduler_prefix_lookup_seconds", "latency of one longest-prefix lookup in Redis",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1), registry=self.registry)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        prom.Gauge(name, help_text, registry=self.registry).set_function(read)

    def counters(self, name: str, help_text: str, label: str, read: Callable[[], dict[str, float]]) -> None:
        """A counter family whose values read() gives, by label value, at each scrape."""
        self.registry.register(_CounterFunction(name, help_text, label, read))

    def on_routed(self, decision: Decision, num_blocks: int) -> None:
        self.decisions.labels(self.policy, decision.reason.value).inc()
        self.prompt_blocks.inc(num_blocks)
        self.cache_hit_blocks.inc(min(decision.num_cached_blocks, num_blocks))

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


async def serve_metrics(metrics: SchedulerMetrics, host: str, port: int) -> Any:
    """Serve GET /metrics on host:port until the returned aiohttp AppRunner is cleaned up."""
    from aiohttp import web  # NOTE: imported only when serving: it is most of the scheduler's start-up time

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
