"""The gateway's Prometheus metrics, in a registry of their own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.loop_lag import LoopLag, LoopLagCollector

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    def __init__(self, loop_lag: LoopLag | None = None) -> None:
        self.registry = CollectorRegistry()
        prefix = "radixserve_gateway_"
        self.registry.register(LoopLagCollector("radixserve_gateway", loop_lag or LoopLag()))
        self.requests = Counter(prefix + "requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram(prefix + "time_to_first_token_seconds", "request arrival to first generated text",
                              ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram(prefix + "e2e_latency_seconds", "request arrival to the last token, successes only",
                             ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.cached_tokens = Counter(prefix + "cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=self.registry)
        self.completion_tokens = Counter(prefix + "completion_tokens", "generated tokens",
                                         registry=self.registry)
        self.in_flight = Gauge(prefix + "requests_in_flight", "generation requests being served",
                               registry=self.registry)
        self.scheduler_metrics_up = Gauge(prefix + "scheduler_metrics_up", "1 when this scrape holds a scheduler's "
                                          "series (worker engine series included), else 0", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
