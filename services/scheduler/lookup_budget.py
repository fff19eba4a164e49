"""How long the scheduler waits for a prefix lookup, and when it stops asking Redis (pure: times passed in).

The budget adapts: `factor` × the 90th percentile of recent lookup latencies, kept within [min_s, max_s]. A
latency is measured on the scheduler's own event loop, so a CPU-starved loop (slow to resume the waiting task,
with Redis itself idle) raises the budget instead of failing lookups that Redis answered in time. One timeout
routes only that request on load alone; `max_timeouts` in a row, or any Redis error, pause lookups for
`retry_s` (a Redis that is down or stalled is not asked again for every request).
"""
from __future__ import annotations

from collections import deque

WINDOW = 64  # recent lookups the budget is computed from


class LookupBudget:
    def __init__(self, min_s: float, max_s: float, retry_s: float, factor: float = 4.0, max_timeouts: int = 3) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError("need 0 < min_s <= max_s")
        self.min_s, self.max_s, self.retry_s = min_s, max_s, retry_s
        self.factor, self.max_timeouts = factor, max_timeouts
        self._latencies: deque[float] = deque(maxlen=WINDOW)
        self._num_timeouts = 0  # in a row
        self.paused_until_s = 0.0  # monotonic; no lookup before it (0: not paused)

    def timeout_s(self) -> float:
        """The wait allowed for the next lookup."""
        if not self._latencies:
            return self.min_s
        recent = sorted(self._latencies)
        p90 = recent[int(0.9 * (len(recent) - 1))]
        return min(self.max_s, max(self.min_s, self.factor * p90))

    def is_paused(self, now_s: float) -> bool:
        return now_s < self.paused_until_s

    def on_success(self, latency_s: float) -> bool:
        """A lookup answered after latency_s; returns whether lookups were paused until now (recovered)."""
        self._latencies.append(latency_s)
        self._num_timeouts = 0
        was_paused, self.paused_until_s = self.paused_until_s > 0, 0.0
        return was_paused

    def on_timeout(self, now_s: float) -> bool:
        """A lookup ran out of budget (it took at least that long); returns whether lookups are now paused."""
        self._latencies.append(self.timeout_s())
        self._num_timeouts += 1
        if self._num_timeouts >= self.max_timeouts:
            self.on_error(now_s)
        return self.is_paused(now_s)

    def on_error(self, now_s: float) -> None:
        """Redis failed (or timed out max_timeouts in a row): no lookups for retry_s."""
        self._num_timeouts = 0
        self.paused_until_s = now_s + self.retry_s
