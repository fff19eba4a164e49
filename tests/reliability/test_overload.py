"""Bounded queues past the gateway: the scheduler holds at most max_queue requests and max_queued_tokens prompt
tokens (beyond: 429 + Retry-After), gives each worker at most max_requests_per_worker (auto: 2 × the worker's
max_num_seqs; the rest wait in that queue for as long as it takes by default), drops a queued request at its
deadline (504), when its client goes away, or after max_queue_wait_s when an operator sets one (503); a
tokenizer holds at most max_requests (beyond: 429). Real processes over ipc://, fake peers. (The gateway's own
429 and 504: tests/reliability/test_faults.py.)"""
from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import zmq

from shared.messages import (AbortRequest, GenerateError, GenerateRequest, RequestFinished, SamplingSpec,
                             SchedulerInbound, TokenizedRequest, TokenizerStreamInbound, WorkerHeartbeat,
                             WorkerInbound, WorkerLoad, decode, encode)
from tests.reliability.cluster import (MODEL, Service, completion, free_port, http_status, scheduler_status,
                                       wait_until)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SPEC = SamplingSpec(max_tokens=4)


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rsov"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Rig:
    """Sockets bound by the test: `replies` (a tokenizer's stream PULL) and `worker` (a worker's PULL)."""

    def __init__(self, sock_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.sock_dir = sock_dir
        self.replies = self._bind(zmq.PULL, "replies")
        self.worker = self._bind(zmq.PULL, "worker")

    def addr(self, name: str) -> str:
        return f"ipc://{self.sock_dir / name}"

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.addr(name))
        return sock

    def dealer(self, addr: str, identity: bytes | None = None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(addr)
        return sock

    def tokenized(self, request_id: str, deadline_s: float | None = None) -> bytes:
        return encode(TokenizedRequest(request_id, [1, 2, 3], [], SPEC, self.addr("replies"), time.time(),
                                       deadline_s=deadline_s))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def take(sock: zmq.Socket, accepts, timeout_s: float = 5.0):
    assert sock.poll(int(timeout_s * 1000)), "nothing arrived"
    return decode(sock.recv_multipart()[-1], accepts)


def is_quiet(sock: zmq.Socket, settle_s: float = 0.3) -> bool:
    return not sock.poll(int(settle_s * 1000))


@pytest.fixture
def rig(sock_dir: Path) -> Iterator[Rig]:
    r = Rig(sock_dir)
    yield r
    r.close()


def start_scheduler(rig: Rig, tmp_path: Path, *extra: str) -> Service:
    service = Service("scheduler", ["services.scheduler", "--scheduler-addr", rig.addr("scheduler"),
                                    "--heartbeat-timeout-s", "30", *extra], tmp_path).start()
    wait_until(lambda: scheduler_status(rig.addr("scheduler"), 0.5) is not None, 20, 0.1)
    return service


def test_scheduler_queue_is_bounded_and_expires_with_clear_errors(rig: Rig, tmp_path: Path) -> None:
    service = start_scheduler(rig, tmp_path, "--max-queue", "2", "--max-queue-wait-s", "1.5")
    try:
        tokenizer = rig.dealer(rig.addr("scheduler"))
        started = time.time()
        tokenizer.send(rig.tokenized("waits"))
        tokenizer.send(rig.tokenized("has-deadline", deadline_s=started + 0.5))
        tokenizer.send(rig.tokenized("one-too-many"))
        assert take(rig.replies, TokenizerStreamInbound) == GenerateError(
            "one-too-many", 429, "rate_limit_error", "scheduler queue is full", retry_after_s=1.0)
        assert take(rig.replies, TokenizerStreamInbound) == GenerateError(
            "has-deadline", 504, "server_error", "the request's deadline passed while it waited for a worker")
        assert 0.4 < time.time() - started < 1.2
        assert take(rig.replies, TokenizerStreamInbound) == GenerateError(
            "waits", 503, "server_error", "no worker could take the request within 1.5 s")
        assert 1.4 < time.time() - started < 2.2
        status = scheduler_status(rig.addr("scheduler"))
        assert (status.num_queued, status.num_in_flight) == (0, 0)
    finally:
        assert service.stop() == 0


def test_scheduler_gives_a_worker_at_most_its_limit_and_queues_the_rest(rig: Rig, tmp_path: Path) -> None:
    service = start_scheduler(rig, tmp_path, "--max-queue", "1", "--max-requests-per-worker", "1")
    try:
        worker = rig.dealer(rig.addr("scheduler"), identity=b"w")
        worker.send(encode(WorkerHeartbeat("w", "i", rig.addr("worker"), "m", "mixed", 16, WorkerLoad(0, 0, 0, 9, 9))))
        wait_until(lambda: scheduler_status(rig.addr("scheduler")).num_workers == 1, 5)
        tokenizer = rig.dealer(rig.addr("scheduler"))
        for request_id in ("r0", "r1", "r2"):
            tokenizer.send(rig.tokenized(request_id))
        assert take(rig.worker, WorkerInbound).request_id == "r0"  # the worker's one seat
        assert take(rig.replies, TokenizerStreamInbound).request_id == "r2"  # r1 queued; the queue is full
        assert is_quiet(rig.worker)
        status = scheduler_status(rig.addr("scheduler"))
        assert (status.num_queued, status.num_in_flight) == (1, 1)
        worker.send(encode(RequestFinished("r0", "w")))  # the seat frees: the queued request goes at once
        assert take(rig.worker, WorkerInbound, timeout_s=0.5).request_id == "r1"
        tokenizer.send(encode(AbortRequest("r1")))
        assert take(rig.worker, WorkerInbound) == AbortRequest("r1")
        status = scheduler_status(rig.addr("scheduler"))
        assert (status.num_queued, status.num_in_flight) == (0, 0)
    finally:
        assert service.stop() == 0


def test_tokenizer_holds_at_most_max_requests(rig: Rig, tmp_path: Path) -> None:
    scheduler = rig.ctx.socket(zmq.ROUTER)  # a fake scheduler that takes requests and answers nothing
    scheduler.setsockopt(zmq.LINGER, 0)
    scheduler.bind(rig.addr("scheduler"))
    service = Service("tokenizer", ["services.tokenizer", "--model", "random:tiny-llama", "--tokenizer-addr",
                                    rig.addr("tokenizer"), "--stream-addr", rig.addr("stream"),
                                    "--scheduler-addrs", rig.addr("scheduler"), "--max-requests", "2",
                                    "--scheduler-ping-interval-s", "600", "--scheduler-timeout-s", "3600"],
                      tmp_path).start()  # NOTE: no pings within the test: the fake does not answer them
    try:
        gateway = rig.dealer(rig.addr("tokenizer"), identity=b"gw")
        for request_id in ("t0", "t1", "t2"):
            gateway.send(encode(GenerateRequest(request_id, SPEC, prompt_token_ids=[1, 2, 3])))
        assert [take(scheduler, SchedulerInbound, 30).request_id for _ in range(2)] == ["t0", "t1"]
        assert take(gateway, GenerateError) == GenerateError(
            "t2", 429, "rate_limit_error",
            "the tokenizer has 2 requests in flight (its max_requests); retry shortly", retry_after_s=1.0)
        gateway.send(encode(AbortRequest("t0")))  # one leaves: room for one more
        assert take(scheduler, SchedulerInbound) == AbortRequest("t0")
        gateway.send(encode(GenerateRequest("t3", SPEC, prompt_token_ids=[1, 2, 3])))
        assert take(scheduler, SchedulerInbound).request_id == "t3"
        assert is_quiet(gateway)
    finally:
        assert service.stop() == 0


def open_stream(port: int, body: dict) -> socket.socket:
    """A raw HTTP client that sent a request and reads nothing: closing it is a client going away."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def test_a_burst_queues_behind_the_workers_seats_until_the_client_leaves_or_the_tokens_run_out(
        rig: Rig, tmp_path: Path) -> None:
    """gateway, tokenizer and scheduler with their defaults (but a queue of 50 prompt tokens), one fake worker
    that reports max_num_seqs 1 and never finishes on its own."""
    scheduler = start_scheduler(rig, tmp_path, "--max-queued-tokens", "50")
    port = free_port()
    services = [scheduler, Service("tokenizer", [
        "services.tokenizer", "--model", MODEL, "--tokenizer-addr", rig.addr("tokenizer"), "--stream-addr",
        rig.addr("stream"), "--scheduler-addrs", rig.addr("scheduler")], tmp_path).start(),
        Service("gateway", ["services.gateway", "--host", "127.0.0.1", "--port", str(port), "--tokenizer-addrs",
                            rig.addr("tokenizer"), "--scheduler-addrs", rig.addr("scheduler")], tmp_path).start()]
    clients: list[socket.socket] = []
    try:
        worker = rig.dealer(rig.addr("scheduler"), identity=b"w")
        worker.send(encode(WorkerHeartbeat("w", "i", rig.addr("worker"), MODEL, "mixed", 16,
                                           WorkerLoad(0, 0, 0, 9, 9, max_num_seqs=1))))
        wait_until(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, 40, 0.2)
        body = completion(MODEL, list(range(1, 21)), 8, stream=True)  # 20 prompt tokens
        for _ in range(2):
            clients.append(open_stream(port, body))
        seated = [take(rig.worker, WorkerInbound, 20) for _ in range(2)]  # auto limit: 2 × max_num_seqs
        assert [r.deadline_s for r in seated] == [None, None]  # no gateway timeout by default
        for num_queued in (1, 2):  # 40 prompt tokens queued
            clients.append(open_stream(port, body))
            wait_until(lambda: scheduler_status(rig.addr("scheduler")).num_queued == num_queued, 20)
        refused = requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=20)
        assert (refused.status_code, refused.headers["Retry-After"]) == (429, "1")  # 60 tokens > 50
        assert refused.json()["error"]["message"] == "scheduler queue is full"
        assert is_quiet(rig.worker)
        clients.pop(2).close()  # a queued request's client goes away: the gateway's abort reaches the queue
        wait_until(lambda: scheduler_status(rig.addr("scheduler")).num_queued == 1, 20)
        worker.send(encode(RequestFinished(seated[0].request_id, "w")))  # a seat frees: the last one goes
        assert take(rig.worker, WorkerInbound).request_id not in {r.request_id for r in seated}
        status = scheduler_status(rig.addr("scheduler"))
        assert (status.num_queued, status.num_in_flight) == (0, 2)
        for client in clients:
            client.close()
        wait_until(lambda: scheduler_status(rig.addr("scheduler")).num_in_flight == 0, 20)
    finally:
        for client in clients:
            client.close()
        assert [service.stop() for service in reversed(services)] == [0, 0, 0]
