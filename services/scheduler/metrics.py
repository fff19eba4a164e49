"""The scheduler's Prometheus metrics (routing decisions by reason, prefix hits, index lookups) and the tiny
aiohttp server that exposes them at /metrics."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import prometheus_client as prom

from services.scheduler.policy import Decision


class SchedulerMetrics:
    """One registry per scheduler process (not the global default, so tests can build several)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.registry = prom.CollectorRegistry()
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
