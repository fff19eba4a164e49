"""Fault injection on real processes (one service per process, over ipc://, random:tiny-llama on the CPU):
client disconnects, deadlines, kill -9 of a worker, of Redis, of a tokenizer replica and of a scheduler replica,
lost and reordered KV events. Each test asserts the outcome and that the cluster's counters are back to their
baseline."""
from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import zmq

from shared.hashing import hash_blocks
from shared.messages import (BlocksRemoved, BlocksStored, CacheSnapshot, KVEventBatch, SnapshotRequest,
                             WorkerGone, WorkerInbound, decode, encode)
from tests.reliability.cluster import MODEL, Cluster, Service, completion, scheduler_status, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HEARTBEAT_TIMEOUT_S = 1.0
SCHEDULER_TIMEOUT_S = 5.0  # the tokenizers' default --scheduler-timeout-s
REQUEST_TIMEOUT_S = 20.0
PAGE = 16
TOTAL_PAGES = 255  # --num-pages 256, one page reserved
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Redis, cache_index, a scheduler (round robin: placement is predictable), two workers (each running at most
    MAX_NUM_SEQS requests at once, the rest wait unstarted) that also heartbeat to an observer, two tokenizers and
    a gateway."""
    c = Cluster(tmp_path_factory.mktemp("faults"))
    try:
        c.start_redis()
        c.start_observer()
        c.start_cache_index()
        c.start_scheduler("--routing", "round_robin")
        c.start_worker(0, "--max-num-seqs", str(MAX_NUM_SEQS))
        c.start_worker(1, "--max-num-seqs", str(MAX_NUM_SEQS))
        c.start_tokenizer(0)
        c.start_tokenizer(1)
        c.start_gateway(2, "--request-timeout-s", str(REQUEST_TIMEOUT_S))
        c.wait_workers(2)
        c.wait_http(c.url)
        yield c
    finally:
        c.close()


def post(url: str, body: dict, timeout_s: float = 60.0) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, timeout=timeout_s)


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 4 for i in range(num_tokens)]


def is_idle(c: Cluster, worker_id: str) -> bool:
    load = c.observer.load(worker_id, fresher_than_s=0.5)
    return load is not None and load.num_running == 0 and load.num_waiting == 0


def assert_back_to_baseline(c: Cluster, workers: tuple[str, ...] = ("worker0", "worker1"),
                            schedulers: list[str] | None = None, dead: tuple[str, ...] = ()) -> None:
    """No request in a scheduler (queued or in flight), none running or waiting on any worker, no dead process
    but those named."""
    wait_until(lambda: all(is_idle(c, w) for w in workers), 10)
    for addr in schedulers or [c.scheduler_addr]:
        status = wait_until(lambda: (s := scheduler_status(addr)) and s.num_in_flight == 0
                            and s.num_queued == 0 and s, 10)
        assert status.num_workers == len(workers)
    assert c.dead_services() == sorted(dead)


def stream_lines(resp: requests.Response) -> Iterator[dict]:
    for line in resp.iter_lines():
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


def test_client_disconnect_aborts_generation_and_frees_its_pages(cluster: Cluster) -> None:
    body = completion(MODEL, prompt(1, 40), 100_000, stream=True)  # runs until the KV pool is full
    for _ in range(2):  # round robin: one stream on each worker
        with requests.post(cluster.url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
            assert resp.status_code == 200
            events = stream_lines(resp)
            for _ in range(5):
                next(events)
            wait_until(lambda: any(not is_idle(cluster, w) for w in ("worker0", "worker1")), 3)  # it runs
        disconnected = time.monotonic()  # the connection is closed here
        wait_until(lambda: all(is_idle(cluster, w) for w in ("worker0", "worker1")), 5)
        assert time.monotonic() - disconnected < 1.5  # aborted at once, not at max_tokens or the context end
    assert_back_to_baseline(cluster)
    # Every page is free or only cached: a prompt that needs the whole pool runs on both workers.
    whole_pool = completion(MODEL, prompt(2, TOTAL_PAGES * PAGE - 8), 4)
    for _ in range(2):
        resp = post(cluster.url, whole_pool)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
    assert_back_to_baseline(cluster)


def test_request_past_its_deadline_gets_504_and_is_aborted(cluster: Cluster) -> None:
    _, url = cluster.start_gateway(2, "--request-timeout-s", "1.5", name="gateway-deadline")
    try:
        cluster.wait_http(url)
        started = time.monotonic()
        resp = post(url, completion(MODEL, prompt(3, 20), 100_000))
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "timeout"
        assert 1.4 < time.monotonic() - started < 4.0
        assert_back_to_baseline(cluster)  # the abort reached the worker: nothing keeps generating
    finally:
        assert cluster.services.pop("gateway-deadline").stop() == 0


def test_gateway_over_its_concurrency_limit_answers_429_with_retry_after(cluster: Cluster) -> None:
    _, url = cluster.start_gateway(2, "--max-concurrent-requests", "2", name="gateway-limited")
    try:
        cluster.wait_http(url)
        long = completion(MODEL, prompt(4, 20), 100_000, stream=True)
        streams = [requests.post(url + "/v1/completions", json=long, stream=True, timeout=30) for _ in range(2)]
        for s in streams:
            assert s.status_code == 200
        refused = post(url, completion(MODEL, prompt(5, 20), 4))
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        for s in streams:
            s.close()
        wait_until(lambda: post(url, completion(MODEL, prompt(5, 20), 4)).status_code == 200, 10, 0.2)
        metrics = requests.get(url + "/metrics", timeout=5).text
        assert "radixserve_gateway_requests_in_flight 0.0" in metrics
        assert_back_to_baseline(cluster)
    finally:
        assert cluster.services.pop("gateway-limited").stop() == 0


def test_killed_worker_fails_its_requests_cleanly_and_a_restarted_one_rejoins(cluster: Cluster) -> None:
    c = cluster
    model_id = MODEL
    long = completion(MODEL, prompt(6, 40), 1800)  # NOTE: long enough to be streaming still at the kill, under any load
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, c.url, long) for _ in range(6)]  # round robin: three on each worker
        # On each worker two run (they have streamed tokens) and one waits, unstarted, for a free seat.
        wait_until(lambda: all((load := c.observer.load(w, 0.5)) and load.num_running == MAX_NUM_SEQS
                               and load.num_waiting == 1 for w in ("worker0", "worker1")), 10)
        time.sleep(0.3)
        c.services["worker0"].kill9()
        killed = time.monotonic()
        wait_until(lambda: (s := scheduler_status(c.scheduler_addr)) and s.num_workers == 1, 5)
        dropped_after_s = time.monotonic() - killed
        statuses = sorted(f.result(timeout=60).status_code for f in futures)
    assert dropped_after_s < HEARTBEAT_TIMEOUT_S + 1.0  # stops routing within a heartbeat timeout (+ one tick)
    # The dead worker's two streaming requests fail cleanly (a re-run could contradict what was streamed); the one
    # that had streamed nothing is re-sent once, to worker1, and finishes like worker1's own three.
    assert statuses == [200, 200, 200, 200, 503, 503]
    resent = [e for t in ("tokenizer0", "tokenizer1") for e in c.services[t].log_events("request re-sent")]
    assert [(e["reason"], e["num_resends"]) for e in resent] == [("worker died", 1)]
    # The scheduler routes only to the live worker now, and the index forgets the dead one.
    for i in range(3):
        assert post(c.url, completion(MODEL, prompt(7 + i, 20), 4)).status_code == 200
    wait_until(lambda: c.worker_blocks("worker0") == set(), 5)
    # A worker restarted by hand with the same id and addresses registers again and is indexed afresh.
    c.start_worker(0)
    c.wait_workers(2)
    fresh = prompt(20, 4 * PAGE + 3)
    for _ in range(2):  # round robin: one lands on worker0
        assert post(c.url, completion(MODEL, fresh, 4)).status_code == 200
    expected = set(hash_blocks(fresh, PAGE, model_id))
    wait_until(lambda: expected <= c.worker_blocks("worker0"), 10)
    assert_back_to_baseline(c)


def test_serving_continues_without_redis_and_the_index_is_rebuilt(cluster: Cluster) -> None:
    c = cluster
    known = prompt(30, 3 * PAGE + 1)
    expected = set(hash_blocks(known, PAGE, MODEL))
    for _ in range(2):  # one copy on each worker
        assert post(c.url, completion(MODEL, known, 2)).status_code == 200
    wait_until(lambda: all(expected <= c.worker_blocks(w) for w in ("worker0", "worker1")), 10)
    c.redis.stop()  # kill -9
    for i in range(4):
        resp = post(c.url, completion(MODEL, prompt(31 + i, 20), 4), timeout_s=30)
        assert resp.status_code == 200, resp.text
    c.redis.start()  # back, empty
    wait_until(lambda: all(expected <= c.worker_blocks(w) for w in ("worker0", "worker1")), 15)
    assert c.dead_services() == []
    assert_back_to_baseline(c)


def test_dead_tokenizer_replica_is_survived_by_the_other(cluster: Cluster) -> None:
    c = cluster
    c.services["tokenizer1"].kill9()
    started = time.monotonic()
    for i in range(6):  # the gateway's DEALER sends only to connected tokenizers
        resp = post(c.url, completion(MODEL, prompt(40 + i, 20), 4), timeout_s=REQUEST_TIMEOUT_S + 5)
        assert resp.status_code == 200, resp.text
    assert time.monotonic() - started < 15
    c.start_tokenizer(1)
    wait_until(lambda: '"event": "serving"' in c.services["tokenizer1"].log_text(), 30, 0.1)
    assert_back_to_baseline(c)


@pytest.fixture
def two_schedulers(tmp_path: Path) -> Iterator[Cluster]:
    """Redis, cache_index, two scheduler replicas (scheduler: at most 2 requests on the worker, the rest queue;
    scheduler1: no such bound), one worker that also heartbeats to an observer, two tokenizers and a gateway."""
    c = Cluster(tmp_path, num_schedulers=2)
    try:
        c.start_redis()
        c.start_observer()
        c.start_cache_index()
        start_replica(c, 0)
        start_replica(c, 1)
        c.start_worker(0)
        c.start_tokenizer(0)
        c.start_tokenizer(1)
        c.start_gateway(2, "--request-timeout-s", str(REQUEST_TIMEOUT_S))
        c.wait_workers(1)
        c.wait_http(c.url)
        yield c
    finally:
        c.close()


def start_replica(c: Cluster, index: int) -> Service:
    seats = ("--max-requests-per-worker", "2") if index == 0 else ()
    return c.start_scheduler("--routing", "round_robin", "--log-level", "debug", *seats, index=index)


def routed_by(service: Service) -> set[str]:
    return {e["request_id"] for e in service.log_events("routed")}


def test_dead_scheduler_replica_is_survived_and_a_restarted_one_serves_again(two_schedulers: Cluster) -> None:
    c = two_schedulers
    dead, live = c.scheduler_addrs
    tokenizers = [c.services[t] for t in ("tokenizer0", "tokenizer1")]
    streams: list[tuple[requests.Response, Iterator[dict], str]] = []
    try:
        # Two endless streams: each tokenizer sends its first request to the first scheduler (its 2 seats).
        for i in range(2):
            resp = requests.post(c.url + "/v1/completions", json=completion(MODEL, prompt(50 + i, 20), 100_000,
                                                                            stream=True), stream=True, timeout=30)
            assert resp.status_code == 200
            events = stream_lines(resp)
            streams.append((resp, events, next(events)["id"]))
        with ThreadPoolExecutor(10) as pool:
            load = [pool.submit(post, c.url, completion(MODEL, prompt(60 + i, 20), 32)) for i in range(6)]
            # A third of them reach the first scheduler; they queue there, behind the streams.
            wait_until(lambda: (s := scheduler_status(dead, 0.5)) and s.num_queued >= 1 and s.num_in_flight == 2,
                       10)
            on_dead = [stream_id for *_, stream_id in streams if stream_id in routed_by(c.services["scheduler"])]
            assert on_dead, "no stream went through the scheduler about to die"
            c.services["scheduler"].kill9()
            killed = time.monotonic()
            fresh = [pool.submit(post, c.url, completion(MODEL, prompt(70 + i, 20), 4)) for i in range(4)]
            assert [f.result(timeout=30).status_code for f in fresh] == [200] * 4  # none sent to the dead one
            fresh_after_s = time.monotonic() - killed
            # The queued ones are re-sent, the routed ones handed over: none waits for the gateway's timeout.
            assert [f.result(timeout=30).status_code for f in load] == [200] * 6
            load_after_s = time.monotonic() - killed
        assert fresh_after_s < 2 * SCHEDULER_TIMEOUT_S + 2.0  # 2 tokenizer timeouts + the requests' own run
        assert load_after_s < REQUEST_TIMEOUT_S / 2
        resent = [e for t in tokenizers for e in t.log_events("request re-sent")]
        assert resent and {e["reason"] for e in resent} == {"its scheduler is gone"}
        handed_over = {e["request_id"] for t in tokenizers for e in t.log_events("request handed over")}
        assert set(on_dead) <= handed_over
        # The streams routed by the dead scheduler stream on (the worker sends straight to the tokenizer).
        wait_until(lambda: (load := c.observer.load("worker0", 0.3)) and load.num_running == 2, 5)
        for _, events, _ in streams:
            for _ in range(20):
                assert next(events)["choices"][0]["finish_reason"] is None
    finally:
        for resp, *_ in streams:  # client disconnects: the gateway aborts them
            resp.close()
    # The aborts reach the worker, also those of the streams whose scheduler died.
    disconnected = time.monotonic()
    wait_until(lambda: is_idle(c, "worker0"), 5)
    assert time.monotonic() - disconnected < 2.0
    assert_back_to_baseline(c, ("worker0",), [live], dead=("scheduler",))
    # Restarted, the replica answers both tokenizers' pings and gets requests again.
    lives = [len(t.log_events("scheduler live")) for t in tokenizers]
    start_replica(c, 0)
    wait_until(lambda: (s := scheduler_status(dead, 0.5)) and s.num_workers == 1, 30)
    wait_until(lambda: all(len(t.log_events("scheduler live")) > n for t, n in zip(tokenizers, lives)), 10)
    answers = [post(c.url, completion(MODEL, prompt(80 + i, 20), 4)) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.json()["id"] for a in answers} & routed_by(c.services["scheduler"])
    assert_back_to_baseline(c, ("worker0",), c.scheduler_addrs)
    # A hung replica (SIGSTOP: its sockets stay open, only the unanswered pings tell) is lost after the timeout:
    # what was sent to it meanwhile is re-sent. Once it answers again it is used again.
    hung = c.services["scheduler1"]
    lives = [len(t.log_events("scheduler live")) for t in tokenizers]
    num_resent = sum(len(t.log_events("request re-sent")) for t in tokenizers)
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(post, c.url, completion(MODEL, prompt(90 + i, 20), 4)) for i in range(4)]
            assert [f.result(timeout=30).status_code for f in answers] == [200] * 4
        assert time.monotonic() - stopped < 2 * SCHEDULER_TIMEOUT_S + 2.0
        assert sum(len(t.log_events("request re-sent")) for t in tokenizers) > num_resent
        assert {e["reason"] for t in tokenizers for e in t.log_events("scheduler lost")} >= {"stopped answering"}
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: all(len(t.log_events("scheduler live")) > n for t, n in zip(tokenizers, lives)), 10)
    c.wait_workers(1, 10)  # NOTE: after its pause it may drop the worker for a moment, until its heartbeat is read
    assert_back_to_baseline(c, ("worker0",), c.scheduler_addrs)


@pytest.fixture
def fake_worker(cluster: Cluster) -> Iterator[zmq.Socket]:
    """A PULL bound where cache_index will send SnapshotRequests for the fake worker `ghost`."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(cluster.ipc("ghost"))
    yield sock
    sock.close()


def test_lost_and_reordered_kv_events_resynchronise_from_a_snapshot(cluster: Cluster,
                                                                   fake_worker: zmq.Socket) -> None:
    c = cluster
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(c.cache_index_addr)

    def send(first_seq: int, *events) -> None:
        push.send(encode(KVEventBatch("ghost", c.ipc("ghost"), "inc-1", first_seq, list(events))))

    def stored(*hashes: int) -> BlocksStored:
        return BlocksStored(list(hashes), None, [0] * (PAGE * len(hashes)), PAGE)

    try:
        send(0, stored(101, 102))
        wait_until(lambda: c.worker_blocks("ghost") == {101, 102}, 5)
        send(2, stored(105))  # seq 1 is lost (for now): a gap
        send(3, stored(106))
        send(1, stored(103))  # ... and arrives late, out of order
        send(0, stored(101, 102))  # a duplicate
        assert fake_worker.poll(5000), "cache_index asked for no snapshot"
        request = decode(fake_worker.recv(), WorkerInbound)
        assert isinstance(request, SnapshotRequest)
        # The worker answers with its cache as of seq 2; the buffered seq 2 and 3 are replayed on top.
        push.send(encode(CacheSnapshot("ghost", "inc-1", 2, [101, 102, 103])))
        wait_until(lambda: c.worker_blocks("ghost") == {101, 102, 103, 105, 106}, 5)
        send(4, BlocksRemoved([101]))
        wait_until(lambda: c.worker_blocks("ghost") == {102, 103, 105, 106}, 5)
        send(1, stored(999))  # stale: ignored
        send(5, stored(107))
        wait_until(lambda: c.worker_blocks("ghost") == {102, 103, 105, 106, 107}, 5)
        assert not fake_worker.poll(300)  # in order again: no further snapshot requested
        push.send(encode(WorkerGone("ghost")))
        wait_until(lambda: c.worker_blocks("ghost") == set(), 5)
    finally:
        push.close()
    assert c.dead_services() == []
