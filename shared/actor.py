"""The actor base: run a service's receive loops and periodic tasks until SIGINT/SIGTERM, then shut down."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger(__name__)


class Actor:
    """Subclasses add coroutines with `spawn` in `start()`, and release resources in `close()`."""

    name = "actor"

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()

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
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await fn()
                except Exception:  # noqa: BLE001 - a periodic task's bug is logged, not fatal
                    log.exception("periodic task failed", task=name)
        self.spawn(loop(), name)

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
        log.info("started", service=self.name)
        try:
            await self._stopped.wait()
            await self.drain()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.close()
            log.info("stopped", service=self.name)
