"""Event-loop lag: how late a task that sleeps a fixed interval wakes up, i.e. how long the loop was held by
something else (a big decode, a per-request loop). The max and a fixed-bucket histogram, for every actor.

Pure core (no clock, no asyncio): the actor base measures and calls observe(); a service with a /metrics
endpoint registers a LoopLagCollector for it (prometheus_client is imported only then).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

LOOP_LAG_INTERVAL_S = 0.05  # how often the monitor wakes up: ~20 cheap wake-ups a second
LOOP_STALL_WARN_S = 0.25  # a wake-up later than this is logged as a stall, with its length
LOOP_LAG_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLag:
    """Lags observed: counts[i] holds those in (bounds[i-1], bounds[i]], counts[-1] those above the last bound."""

    def __init__(self, bounds_s: tuple[float, ...] = LOOP_LAG_BOUNDS_S) -> None:
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)
        self.sum_s = 0.0
        self.max_s = 0.0
        self.num_stalls = 0  # lags of LOOP_STALL_WARN_S or more

    def observe(self, lag_s: float) -> bool:
        """Count one wake-up `lag_s` late; True when it is a stall worth a warning."""
        lag_s = max(0.0, lag_s)
        self.counts[bisect_left(self.bounds_s, lag_s)] += 1
        self.sum_s += lag_s
        self.max_s = max(self.max_s, lag_s)
        is_stall = lag_s >= LOOP_STALL_WARN_S
        self.num_stalls += is_stall
        return is_stall


class LoopLagCollector:
    """`<prefix>_event_loop_lag_seconds` (histogram) and `<prefix>_event_loop_max_lag_seconds` (gauge), per scrape."""

    def __init__(self, prefix: str, lag: LoopLag) -> None:
        self._prefix, self._lag = prefix, lag

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        lag = self._lag
        bounds = [floatToGoString(b) for b in lag.bounds_s] + ["+Inf"]
        histogram = HistogramMetricFamily(f"{self._prefix}_event_loop_lag_seconds",
                                          "how late the event loop ran a task that sleeps "
                                          f"{LOOP_LAG_INTERVAL_S} s (time the loop was held by other work)")
        histogram.add_metric([], list(zip(bounds, accumulate(lag.counts))), lag.sum_s)
        yield histogram
        yield GaugeMetricFamily(f"{self._prefix}_event_loop_max_lag_seconds",
                                "the longest event-loop stall since the process started", value=lag.max_s)
