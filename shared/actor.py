"""The actor base: run a service's receive loops and periodic tasks until SIGINT/SIGTERM, then shut down."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import structlog

from shared.loop_lag import LOOP_LAG_INTERVAL_S, LoopLag

log = structlog.get_logger(__name__)

# After a stop signal: how long the loops get to end once cancelled. A task that swallows its cancellation (a
# library converting CancelledError into an error that a loop's `except Exception` logs and goes on from) is
# cancelled again each second, then left behind, logged, so that close() runs and the process exits.
STOP_GRACE_S = 5.0


class Actor:
    """Subclasses add coroutines with `spawn` in `start()`, and release resources in `close()`."""

    name = "actor"

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self.loop_lag = LoopLag()

    async def start(self) -> None:
        """Bind sockets and spawn loops (override)."""

    async def close(self) -> None:
        """Close sockets and flush state (override)."""

    async def drain(self) -> None:
        """After a stop signal, before any loop is cancelled: let in-flight work finish (override)."""

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(self._on_task_done)
        self._tasks.append(task)

    def every(self, interval_s: float, fn: Callable[[], Awaitable[None]], name: str) -> None:
        async def loop() -> None:
            while True:  # NOTE: also during drain(): a draining worker still heartbeats
                await asyncio.sleep(interval_s)
                try:
                    await fn()
                except Exception:  # noqa: BLE001 - a periodic task's bug is logged, not fatal
                    log.exception("periodic task failed", task=name)
        self.spawn(loop(), name)

    async def _watch_loop_lag(self) -> None:
        """Sleep LOOP_LAG_INTERVAL_S at a time and count how late each wake-up comes; warn about a stall."""
        loop = asyncio.get_running_loop()
        while True:
            due_s = loop.time() + LOOP_LAG_INTERVAL_S
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            lag_s = loop.time() - due_s
            if self.loop_lag.observe(lag_s):
                log.warning("event loop stalled", service=self.name, stall_ms=round(lag_s * 1000))

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task died; stopping", task=task.get_name(), error=repr(exc))
            self._stopped.set()

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (NotImplementedError, RuntimeError):
                pass
        await self.start()
        self.spawn(self._watch_loop_lag(), "loop-lag")  # NOTE: after start(): a model load is not a stall
        log.info("started", service=self.name)
        try:
            await self._stopped.wait()
            await self.drain()
        finally:
            await self._cancel_tasks()
            await self.close()
            log.info("stopped", service=self.name, max_loop_stall_ms=round(self.loop_lag.max_s * 1000),
                     num_loop_stalls=self.loop_lag.num_stalls)

    async def _cancel_tasks(self) -> None:
        """Cancel every loop and wait for them to end, for STOP_GRACE_S at most (see there)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_GRACE_S
        pending = {task for task in self._tasks if not task.done()}
        while pending:
            for task in pending:
                task.cancel()
            left = deadline - loop.time()
            if left <= 0:
                log.error("tasks ignored cancellation; leaving them", tasks=sorted(t.get_name() for t in pending))
                return
            _, pending = await asyncio.wait(pending, timeout=min(1.0, left))
