"""The loop-lag monitor: its counts and max, the Prometheus families it renders, and the actor base measuring a
stall that a blocking call causes."""
from __future__ import annotations

import asyncio
import time

import prometheus_client as prom

from shared.actor import Actor
from shared.loop_lag import LOOP_STALL_WARN_S, LoopLag, LoopLagCollector


def test_lags_are_counted_per_bucket_with_their_max_and_stalls() -> None:
    lag = LoopLag((0.01, 0.1, 1.0))
    assert [lag.observe(s) for s in (-0.001, 0.005, 0.01, 0.05, LOOP_STALL_WARN_S, 2.0)] == \
        [False, False, False, False, True, True]
    assert lag.counts == [3, 1, 1, 1]  # (.., 0.01], (0.01, 0.1], (0.1, 1], above 1
    assert (lag.max_s, lag.num_stalls) == (2.0, 2)
    assert abs(lag.sum_s - (0.005 + 0.01 + 0.05 + LOOP_STALL_WARN_S + 2.0)) < 1e-12


def test_the_collector_renders_a_cumulative_histogram_and_the_max() -> None:
    lag = LoopLag((0.01, 0.1))
    for lag_s in (0.002, 0.05, 0.3):
        lag.observe(lag_s)
    registry = prom.CollectorRegistry()
    registry.register(LoopLagCollector("radixserve_x", lag))
    text = prom.generate_latest(registry).decode()
    assert 'radixserve_x_event_loop_lag_seconds_bucket{le="0.01"} 1.0' in text
    assert 'radixserve_x_event_loop_lag_seconds_bucket{le="0.1"} 2.0' in text
    assert 'radixserve_x_event_loop_lag_seconds_bucket{le="+Inf"} 3.0' in text
    assert "radixserve_x_event_loop_lag_seconds_count 3.0" in text
    assert "radixserve_x_event_loop_max_lag_seconds 0.3" in text


class Blocking(Actor):
    """Holds its event loop for block_s once, then stops."""

    def __init__(self, block_s: float) -> None:
        super().__init__()
        self.block_s = block_s

    async def start(self) -> None:
        self.spawn(self._block(), "block")

    async def _block(self) -> None:
        await asyncio.sleep(0.2)  # the monitor is running by then
        time.sleep(self.block_s)  # NOTE: on purpose: what a big decode on the loop does
        await asyncio.sleep(0.2)
        self.stop()


def test_the_actor_measures_a_stall_of_its_loop() -> None:
    service = Blocking(0.4)
    asyncio.run(service.run())
    assert 0.35 <= service.loop_lag.max_s < 2.0
    assert service.loop_lag.num_stalls >= 1
    assert sum(service.loop_lag.counts) >= 5  # it kept waking up around the stall
