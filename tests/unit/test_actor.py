"""The actor base's shutdown: after a stop, every loop is cancelled and close() runs, also when a task swallows its
cancellation (as a library that turns CancelledError into an error a loop's `except Exception` goes on from)."""
from __future__ import annotations

import asyncio
import time

from shared import actor as actor_mod
from shared.actor import Actor


class Stubborn(Actor):
    """One loop that swallows its first `swallow` cancellations (all of them until `release` is set, if None)."""

    def __init__(self, swallow: int | None) -> None:
        super().__init__()
        self.swallow, self.swallowed, self.closed = swallow, 0, False
        self.release = asyncio.Event()

    async def start(self) -> None:
        self.spawn(self._loop(), "stubborn")
        self.every(0.01, self._tick, "tick")

    async def _tick(self) -> None:
        pass

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if self.swallow is not None and self.swallowed >= self.swallow:
                    raise
                if self.swallow is None and self.release.is_set():
                    return
                self.swallowed += 1

    async def close(self) -> None:
        self.closed = True


def _run_until_stopped(service: Stubborn) -> float:
    async def main() -> float:
        runner = asyncio.ensure_future(service.run())
        await asyncio.sleep(0.05)
        start = time.monotonic()
        service.stop()
        await asyncio.wait_for(runner, 10)
        seconds = time.monotonic() - start
        service.release.set()  # a task left behind may end now, so that asyncio.run's own cleanup ends
        return seconds

    return asyncio.run(main())


def test_a_task_that_swallows_cancellations_is_cancelled_again_until_it_ends():
    service = Stubborn(swallow=2)
    seconds = _run_until_stopped(service)
    assert service.swallowed == 2 and service.closed
    assert seconds < 3.5  # re-cancelled once a second


def test_a_task_that_never_ends_is_left_behind_after_the_grace(monkeypatch):
    monkeypatch.setattr(actor_mod, "STOP_GRACE_S", 0.3)
    service = Stubborn(swallow=None)
    seconds = _run_until_stopped(service)
    assert service.closed and service.swallowed >= 1
    assert seconds < 1.5
