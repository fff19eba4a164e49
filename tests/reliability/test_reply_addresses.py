"""Reply addresses at real services (issue 31, items 2 and 3): 2,000 distinct ones at a worker, and one that never
reads at the scheduler; each service stays alive and keeps answering everyone else."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shared.messages import (CacheSnapshot, GenerateError, MetricsReply, MetricsRequest, SamplingSpec,
                             SnapshotRequest, TokenizedRequest, decode, encode)
from tests.reliability.cluster import Cluster, scheduler_status, wait_until, zmq_socket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NUM_ADDRS = 2_000  # past libzmq's cap of 1,023 sockets per context
NUM_FLOOD = 110_000  # past the 100,000 messages queued for one peer


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def _take(sock: zmq.Socket, accepts: type, timeout_s: float) -> object | None:
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return decode(sock.recv_multipart()[-1], accepts)


def test_two_thousand_reply_addresses_at_a_worker(cluster: Cluster, ctx: zmq.Context) -> None:
    """Item 2: a worker opened one PUSH per reply address for ever; near the 1,020th, ZMQError('Too many open
    files') killed its send task and the worker exited. Now it replies to every one and keeps serving."""
    observer = cluster.start_observer()
    worker = cluster.start_worker(0)
    wait_until(lambda: observer.load("worker0"), timeout_s=90)
    to_worker = zmq_socket(ctx, zmq.PUSH, cluster.ipc("worker0"))
    for i in range(NUM_ADDRS):
        to_worker.send(encode(SnapshotRequest(reply_addr=cluster.ipc(f"gone{i}"))))
    inbox = zmq_socket(ctx, zmq.PULL, cluster.ipc("inbox"), bind=True)
    to_worker.send(encode(SnapshotRequest(reply_addr=cluster.ipc("inbox"))))
    snapshot = _take(inbox, CacheSnapshot, 30)
    assert isinstance(snapshot, CacheSnapshot) and snapshot.worker_id == "worker0"
    assert worker.is_alive
    time.sleep(0.5)
    assert observer.load("worker0", fresher_than_s=0.5) is not None  # its heartbeats still go out


def _request(request_id: str, reply_addr: str) -> bytes:
    return encode(TokenizedRequest(request_id, [1], [], SamplingSpec(max_tokens=1), reply_addr, time.time()))


def test_a_reply_address_that_never_reads_does_not_wedge_the_scheduler(cluster: Cluster, ctx: zmq.Context) -> None:
    """Item 3: past 100,000 messages queued for a reply address nobody reads, `await send` held the scheduler's
    receive loop for ever: every status query timed out and every request waited. Now the scheduler waits a
    bounded time once, drops and counts, and answers everyone else at once."""
    cluster.start_redis()
    cluster.start_scheduler("--max-queue", "0")  # no worker and no queue: every request gets a 429 at once
    cluster.wait_workers(0)
    deaf = zmq_socket(ctx, zmq.PULL, cluster.ipc("deaf"), bind=True, rcvhwm=1)
    inbox = zmq_socket(ctx, zmq.PULL, cluster.ipc("inbox"), bind=True)
    client = zmq_socket(ctx, zmq.DEALER, cluster.scheduler_addr)
    for i in range(NUM_FLOOD):
        client.send(_request(f"flood-{i}", cluster.ipc("deaf")))
    client.send(_request("other", cluster.ipc("inbox")))  # handled after the whole flood
    error = _take(inbox, GenerateError, 90)
    assert isinstance(error, GenerateError) and (error.request_id, error.status) == ("other", 429)
    assert scheduler_status(cluster.scheduler_addr, timeout_s=5) is not None
    client.send(encode(MetricsRequest("m1")))
    reply = _take(client, MetricsReply, 5)
    assert isinstance(reply, MetricsReply)
    dropped = {line.split(" ")[0]: float(line.split(" ")[1]) for line in reply.text.decode().splitlines()
               if line.startswith("radixserve_scheduler_dropped_messages_total")}
    assert dropped['radixserve_scheduler_dropped_messages_total{reason="peer_full"}'] >= 1
    assert cluster.services["scheduler"].is_alive
    deaf.close()
