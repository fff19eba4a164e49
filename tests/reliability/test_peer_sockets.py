"""Sends to many peers and to peers that never read (issue 31, items 2 and 3), at transport.PushPool with real
ZeroMQ sockets: the pool stays under libzmq's 1,023-socket cap, and a full peer costs a bounded wait, not a hang."""
from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared import transport
from shared.messages import GenerateError, decode
from tests.reliability.cluster import zmq_socket

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

NUM_ADDRS = 2_000  # past libzmq's default cap of 1,023 sockets per context
HANG_S = 10.0  # a send that takes this long is stuck


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rspeer"))  # short: ipc:// paths are limited to ~107 bytes
    yield path
    for sock_file in path.iterdir():
        sock_file.unlink()
    path.rmdir()


def _msg(i: int) -> GenerateError:
    return GenerateError(f"r{i}", 503, "server_error", "x")


async def test_two_thousand_reply_addresses_keep_the_pool_bounded(ipc_dir: Path, ctx: zmq.Context) -> None:
    """Item 2: one socket per address for ever hit ZMQError('Too many open files') at about the 1,020th address,
    raised out of send(). Bounded, the oldest sockets close and every address still gets its message queued."""
    live = f"ipc://{ipc_dir / 'live'}"
    receiver = zmq_socket(ctx, zmq.PULL, live, bind=True)
    pool = transport.PushPool()
    try:
        results = [await pool.send(f"ipc://{ipc_dir / f'gone{i}'}", _msg(i)) for i in range(NUM_ADDRS)]
        assert await pool.send(live, _msg(NUM_ADDRS)) is None
        assert receiver.poll(5000)
        assert decode(receiver.recv(), GenerateError).request_id == f"r{NUM_ADDRS}"
        assert results == [None] * NUM_ADDRS and sum(pool.num_dropped.values()) == 0
        assert len(pool) == transport.MAX_PEERS
    finally:
        pool.close()
        receiver.close()


async def test_a_bad_address_is_dropped_and_counted(ipc_dir: Path) -> None:
    pool = transport.PushPool()
    try:
        assert await pool.send("nonsense://x", _msg(0)) is transport.DropReason.INVALID_ADDRESS
        assert (pool.num_dropped[transport.DropReason.INVALID_ADDRESS], len(pool)) == (1, 0)
    finally:
        pool.close()


async def _fill(pool: transport.PushPool, addr: str) -> tuple[int, float]:
    """Send to addr until a send is dropped: (messages queued before it, seconds the dropped send took)."""
    frame_count = 0
    while True:
        started = time.monotonic()
        dropped = await asyncio.wait_for(pool.send(addr, _msg(frame_count)), HANG_S)
        if dropped is not None:
            assert dropped is transport.DropReason.PEER_FULL
            return frame_count, time.monotonic() - started
        frame_count += 1


async def test_a_peer_that_never_reads_costs_one_bounded_wait(ipc_dir: Path, ctx: zmq.Context) -> None:
    """Item 3: past MAX_QUEUED_MESSAGES unread, `await send` used to block for ever (a worker's only send path, a
    scheduler's receive loop). Now the send waits max_wait_s, drops its message, counts it and forgets the peer;
    the others are served at once, and a forgotten peer that fills its queue again costs no wait at all."""
    deaf, live = f"ipc://{ipc_dir / 'deaf'}", f"ipc://{ipc_dir / 'live'}"
    never_reads = zmq_socket(ctx, zmq.PULL, deaf, bind=True, rcvhwm=1)
    receiver = zmq_socket(ctx, zmq.PULL, live, bind=True)
    pool = transport.PushPool()
    try:
        num_queued, wait_s = await _fill(pool, deaf)
        assert num_queued >= transport.MAX_QUEUED_MESSAGES
        assert transport.MAX_SEND_WAIT_S <= wait_s < transport.MAX_SEND_WAIT_S + 2.0
        assert (pool.num_forgotten, pool.num_dropped[transport.DropReason.PEER_FULL], len(pool)) == (1, 1, 0)
        assert await pool.send(live, _msg(-1)) is None
        assert receiver.poll(5000) and decode(receiver.recv(), GenerateError).request_id == "r-1"
        num_queued, wait_s = await _fill(pool, deaf)  # a fresh queue, then dropped without a wait
        assert num_queued >= transport.MAX_QUEUED_MESSAGES - 2_000  # what the peer's side still held is gone
        assert wait_s < transport.MAX_SEND_WAIT_S / 2
        assert (pool.num_forgotten, pool.num_dropped[transport.DropReason.PEER_FULL]) == (2, 2)
    finally:
        pool.close()
        never_reads.close()
        receiver.close()
