"""Fixtures shared by the reliability tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A ZeroMQ context of the test's own sockets, destroyed after it."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
