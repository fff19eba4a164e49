"""The gpu_worker process over ipc:// with fake peers: a scheduler ROUTER, a tokenizer stream PULL and a
cache_index PULL; requests go in through a PUSH to the worker, exactly as a scheduler sends them."""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.request import SamplingParams
from shared.hashing import hash_blocks
from shared.messages import (AbortRequest, BlocksRemoved, BlocksStored, CacheIndexInbound, CacheSnapshot,
                             GenerateError, KVEventBatch, RequestFinished, SamplingSpec, SchedulerInbound,
                             SnapshotRequest, TokenBatch, TokenizedRequest, TokenizerStreamInbound,
                             TokenOutputs, WorkerGone, WorkerHeartbeat, decode, encode)

pytestmark = pytest.mark.slow

MODEL = "random:tiny-llama"
VOCAB = 512
PAGE = 4
NUM_PAGES = 512
WORKER_ID = "w0"
TIMEOUT_S = 60.0  # generous: the first message waits for torch to import and the model to load
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Inbox:
    """A bound test socket whose messages are decoded, numbered in arrival order and kept until taken."""

    sock: zmq.Socket
    accepts: Any
    has_identity: bool = False
    pending: list[tuple[int, Any]] = field(default_factory=list)
    identities: set[bytes] = field(default_factory=set)
    num_arrived: int = 0
    last_taken: int = -1  # arrival number of the message take() returned last

    def take(self, match: Callable[[Any], bool], timeout_s: float = TIMEOUT_S, after: int = -1) -> Any:
        """The first message that arrived after arrival number `after` for which match is true."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, (number, msg) in enumerate(self.pending):
                if number > after and match(msg):
                    self.last_taken = number
                    return self.pending.pop(i)[1]
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self.sock.poll(remaining_ms):
                raise TimeoutError(f"no matching message within {timeout_s}s")
            self._receive()

    def take_all(self, kind: type, settle_s: float = 0.3) -> list[Any]:
        """Every message of this kind that arrives until none came for settle_s."""
        taken = []
        while True:
            try:
                taken.append(self.take(lambda m: isinstance(m, kind), settle_s))
            except TimeoutError:
                return taken

    def now(self) -> int:
        """Read what is waiting; the arrival number from which later messages count as new."""
        while self.sock.poll(0):
            self._receive()
        return self.num_arrived - 1

    def _receive(self) -> None:
        frames = self.sock.recv_multipart()
        if self.has_identity:
            self.identities.add(frames[0])
        self.pending.append((self.num_arrived, decode(frames[-1], self.accepts)))
        self.num_arrived += 1


@dataclass
class Worker:
    process: subprocess.Popen
    addr: str
    stream_addr: str
    index_addr: str
    scheduler: Inbox
    stream: Inbox
    index: Inbox
    push: zmq.Socket
    received: dict[str, list[TokenOutputs]] = field(default_factory=dict)

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(encode(msg))

    def request(self, request_id: str, prompt: list[int], **sampling: Any) -> None:
        self.send(TokenizedRequest(request_id, prompt, hash_blocks(prompt, PAGE, MODEL),
                                   SamplingSpec(**sampling), self.stream_addr, time.time()))

    def outputs(self, request_id: str, num_samples: int = 1) -> list[TokenOutputs]:
        """Every TokenOutputs of request_id, in arrival order, until all its samples ended."""
        while sum(o.finish_reason is not None for o in self.received.get(request_id, [])) < num_samples:
            self.next_batch()
        return self.received.pop(request_id)

    def next_batch(self) -> TokenBatch:
        """The next TokenBatch; its outputs are also kept per request for outputs()."""
        batch = self.stream.take(lambda m: isinstance(m, TokenBatch))
        assert batch.worker_id == WORKER_ID
        for out in batch.outputs:
            self.received.setdefault(out.request_id, []).append(out)
        return batch

    def error(self, request_id: str) -> GenerateError:
        return self.stream.take(lambda m: isinstance(m, GenerateError) and m.request_id == request_id)

    def finished(self, request_id: str) -> RequestFinished:
        return self.scheduler.take(lambda m: isinstance(m, RequestFinished) and m.request_id == request_id)

    def heartbeat(self, match: Callable[[WorkerHeartbeat], bool] = lambda hb: True,
                  after: int = -1) -> WorkerHeartbeat:
        return self.scheduler.take(lambda m: isinstance(m, WorkerHeartbeat) and match(m), after=after)

    def snapshot(self) -> CacheSnapshot:
        self.send(SnapshotRequest(self.index_addr))
        return self.index.take(lambda m: isinstance(m, CacheSnapshot))


@contextlib.contextmanager
def _running_worker(*extra_argv: str) -> Iterator[Worker]:
    ipc_dir = Path(tempfile.mkdtemp(prefix="rsw"))  # short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    addrs = {name: f"ipc://{ipc_dir / name}" for name in ("worker", "sched", "stream", "index")}
    scheduler = Inbox(_bind(ctx, zmq.ROUTER, addrs["sched"]), SchedulerInbound, has_identity=True)
    stream = Inbox(_bind(ctx, zmq.PULL, addrs["stream"]), TokenizerStreamInbound)
    index = Inbox(_bind(ctx, zmq.PULL, addrs["index"]), CacheIndexInbound)
    argv = [sys.executable, "-m", "services.gpu_worker", "--worker-id", WORKER_ID,
            "--worker-addr", addrs["worker"], "--scheduler-addrs", addrs["sched"],
            "--cache-index-addr", addrs["index"], "--model", MODEL, "--device", "cpu",
            "--page-size", str(PAGE), "--num-pages", str(NUM_PAGES), "--heartbeat-interval-s", "0.1", *extra_argv]
    process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "RADIXSERVE_LOG_JSON": "1"})
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(addrs["worker"])
    handle = Worker(process, addrs["worker"], addrs["stream"], addrs["index"], scheduler, stream, index, push)
    try:
        handle.heartbeat()  # serving from here on
        yield handle
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    """One worker shared by the tests that do not depend on a fresh cache or event sequence."""
    with _running_worker() as handle:
        yield handle


@pytest.fixture
def fresh_worker() -> Iterator[Worker]:
    with _running_worker() as handle:
        yield handle


def _bind(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(length)]  # ids 2 and 3 are tiny-llama's EOS


def _engine() -> Engine:
    return Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32", page_size=PAGE, num_pages=NUM_PAGES))


def _tokens(outputs: list[TokenOutputs], index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def _stored_hashes(batches: list[KVEventBatch]) -> list[int]:
    return [h for b in batches for e in b.events if isinstance(e, BlocksStored) for h in e.block_hashes]


def test_greedy_tokens_equal_the_in_process_engine(worker: Worker) -> None:
    prompt = _prompt(37)
    worker.request("greedy", prompt, max_tokens=9, temperature=0.0, ignore_eos=True)

    outputs = worker.outputs("greedy")

    expected = _engine().generate([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert _tokens(outputs) == expected[0].samples[0].token_ids
    assert [len(o.token_ids) for o in outputs] == [1] * 9
    assert [o.finish_reason for o in outputs] == [None] * 8 + ["length"]
    assert {(o.index, o.num_prompt_tokens, o.num_cached_tokens, o.logprobs) for o in outputs} == {(0, 37, 0, None)}
    assert worker.finished("greedy") == RequestFinished("greedy", WORKER_ID)


def test_n_seeded_samples_with_logprobs_equal_the_in_process_engine(worker: Worker) -> None:
    prompt = _prompt(10, seed=1)
    spec = dict(max_tokens=6, temperature=0.9, seed=5, n=3, logprobs=2, ignore_eos=True)
    worker.request("sampled", prompt, **spec)

    outputs = worker.outputs("sampled", num_samples=3)

    expected = _engine().generate([prompt], SamplingParams(**spec))[0].samples
    assert [_tokens(outputs, i) for i in range(3)] == [s.token_ids for s in expected]
    for i, sample in enumerate(expected):
        entries = [e for o in outputs if o.index == i for e in o.logprobs]
        assert [e.token_id for e in entries] == sample.token_ids
        assert [len(e.top) for e in entries] == [2] * 6
        assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in sample.logprobs], abs=1e-5)
    assert sorted(o.index for o in outputs if o.finish_reason == "length") == [0, 1, 2]
    assert worker.finished("sampled") == RequestFinished("sampled", WORKER_ID)
    assert [m.request_id for m in worker.scheduler.take_all(RequestFinished)].count("sampled") == 0


def test_kv_events_are_numbered_without_gaps_and_match_the_snapshot(fresh_worker: Worker) -> None:
    worker = fresh_worker
    prompts = [_prompt(42, seed=2), _prompt(42, seed=2)[:20] + _prompt(13, seed=3)]
    for i, prompt in enumerate(prompts):
        worker.request(f"kv{i}", prompt, max_tokens=1, temperature=0.0)
        worker.outputs(f"kv{i}")
        worker.finished(f"kv{i}")

    batches = worker.index.take_all(KVEventBatch)
    snapshot = worker.snapshot()

    seqs = [b.first_seq + k for b in batches for k in range(len(b.events))]
    assert seqs == list(range(len(seqs)))
    assert {(b.worker_id, b.worker_addr, b.incarnation) for b in batches} == {
        (WORKER_ID, worker.addr, snapshot.incarnation)}
    assert not any(isinstance(e, BlocksRemoved) for b in batches for e in b.events)
    first = hash_blocks(prompts[0], PAGE, MODEL)  # 10 full pages
    second = hash_blocks(prompts[1], PAGE, MODEL)  # 8 full pages, the first 5 shared with the first prompt
    assert first[:5] == second[:5]
    assert _stored_hashes(batches) == first + second[5:]
    assert snapshot.worker_id == WORKER_ID
    assert snapshot.next_seq == len(seqs)
    assert sorted(snapshot.block_hashes) == sorted(first + second[5:])


def test_a_cached_prefix_is_reported_in_num_cached_tokens(worker: Worker) -> None:
    prompt = _prompt(30, seed=4)
    worker.request("cold", prompt, max_tokens=2, temperature=0.0)
    cold = worker.outputs("cold")
    worker.request("warm", prompt, max_tokens=2, temperature=0.0)
    warm = worker.outputs("warm")

    assert {o.num_cached_tokens for o in cold} == {0}
    assert {o.num_cached_tokens for o in warm} == {28}  # 7 full pages of 4 tokens
    assert _tokens(cold) == _tokens(warm)


def test_heartbeats_carry_identity_and_load(worker: Worker) -> None:
    idle = worker.heartbeat(after=worker.scheduler.now())
    assert (idle.worker_id, idle.addr, idle.model_id, idle.role, idle.page_size) == (
        WORKER_ID, worker.addr, MODEL, "mixed", PAGE)
    assert (idle.load.num_running, idle.load.num_waiting, idle.load.num_queued_tokens) == (0, 0, 0)
    num_cached = len(worker.snapshot().block_hashes)  # earlier tests on this worker left pages cached
    assert idle.load.num_total_pages == NUM_PAGES - 1
    assert idle.load.num_free_pages == NUM_PAGES - 1 - num_cached
    assert set(worker.scheduler.identities) == {WORKER_ID.encode()}

    worker.request("long", _prompt(8), max_tokens=1500, temperature=0.0, ignore_eos=True)
    busy = worker.heartbeat(lambda hb: hb.load.num_running == 1)

    assert busy.incarnation == idle.incarnation
    assert busy.load.num_free_pages < NUM_PAGES - 1
    worker.send(AbortRequest("long"))
    worker.finished("long")


def test_abort_mid_generation_ends_with_abort_and_frees_the_pages(fresh_worker: Worker) -> None:
    worker = fresh_worker
    worker.request("doomed", _prompt(21, seed=6), max_tokens=1500, temperature=0.0, ignore_eos=True)
    worker.next_batch()  # generating now

    worker.send(AbortRequest("doomed"))
    outputs = worker.outputs("doomed")
    assert worker.finished("doomed") == RequestFinished("doomed", WORKER_ID)
    idle = worker.heartbeat(after=worker.scheduler.last_taken)  # sent after the abort took effect
    snapshot = worker.snapshot()

    assert outputs[-1].finish_reason == "abort" and outputs[-1].token_ids == []
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert len(outputs) - 1 < 1500
    assert (idle.load.num_running, idle.load.num_waiting, idle.load.num_queued_tokens) == (0, 0, 0)
    # every page the request held went back, except the full pages of its KV that the radix cache kept
    num_cached = len(snapshot.block_hashes)
    assert num_cached == (21 + len(outputs) - 2) // PAGE  # the last sampled token's KV was never computed
    assert idle.load.num_free_pages == idle.load.num_total_pages - num_cached


def test_abort_of_a_waiting_n_request_ends_every_sample(worker: Worker) -> None:
    worker.request("blocker", _prompt(8), max_tokens=1500, temperature=0.0, ignore_eos=True)
    worker.next_batch()
    worker.request("forked", _prompt(8, seed=9), max_tokens=1500, n=2, ignore_eos=True)
    worker.send(AbortRequest("forked"))
    worker.send(AbortRequest("blocker"))

    outputs = worker.outputs("forked", num_samples=2)

    assert sorted(o.index for o in outputs if o.finish_reason == "abort") == [0, 1]
    assert worker.finished("forked") == RequestFinished("forked", WORKER_ID)
    assert worker.finished("blocker") == RequestFinished("blocker", WORKER_ID)


@pytest.mark.parametrize("prompt, sampling, message, error_code, param", [
    ([5, VOCAB], {}, f"prompt token ids must be in [0, {VOCAB})", None, None),
    ([], {}, "the prompt is empty", None, None),
    ([5, 6], {"top_p": 0.0}, "Invalid 'top_p': decimal below minimum value. Expected a value > 0, but got 0.0 instead.",
     "decimal_below_min_value", "top_p"),
    ([5, 6], {"max_tokens": -1},
     "Invalid 'max_tokens': integer below minimum value. Expected a value >= 0, but got -1 instead.",
     "integer_below_min_value", "max_tokens"),
    ([5, 6], {"logit_bias": ((3, 1.0), (VOCAB, 5.0))}, f"Invalid key in 'logit_bias': {VOCAB}. Maximum value is "
     f"{VOCAB - 1}.", "invalid_value", "logit_bias"),
])
def test_an_invalid_request_gets_400_and_the_worker_serves_on(worker: Worker, prompt: list[int], sampling: dict,
                                                               message: str, error_code: str | None,
                                                               param: str | None) -> None:
    worker.request("bad", prompt, **sampling)

    assert worker.error("bad") == GenerateError("bad", 400, "invalid_request_error", message, error_code=error_code,
                                                param=param)
    assert worker.finished("bad") == RequestFinished("bad", WORKER_ID)
    worker.request("good", [5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert len(_tokens(worker.outputs("good"))) == 2


def test_a_request_past_its_deadline_gets_504(worker: Worker) -> None:
    prompt = [5, 6, 7]
    worker.send(TokenizedRequest("late", prompt, [], SamplingSpec(), worker.stream_addr, time.time() - 2,
                                 deadline_s=time.time() - 1))

    error = worker.error("late")

    assert (error.status, error.code) == (504, "timeout")
    assert worker.finished("late") == RequestFinished("late", WORKER_ID)
    worker.request("next", [5, 6], max_tokens=1)
    worker.outputs("next")
    assert "late" not in worker.received  # no TokenBatch carried it


def test_a_duplicate_request_id_is_refused_without_ending_the_original(worker: Worker) -> None:
    worker.request("twice", _prompt(8), max_tokens=300, temperature=0.0, ignore_eos=True)
    worker.request("twice", _prompt(8), max_tokens=300, temperature=0.0, ignore_eos=True)

    error = worker.error("twice")
    outputs = worker.outputs("twice")

    assert error.status == 400 and "already in use" in error.message
    assert len(_tokens(outputs)) == 300 and outputs[-1].finish_reason == "length"
    assert worker.finished("twice") == RequestFinished("twice", WORKER_ID)
    assert [m.request_id for m in worker.scheduler.take_all(RequestFinished)].count("twice") == 0


def test_garbage_frames_are_dropped(worker: Worker) -> None:
    worker.push.send(b"\xc1not msgpack")
    worker.push.send(b"")
    worker.push.send(encode(WorkerGone("someone")))  # valid msgpack, not a type the worker accepts
    worker.push.send_multipart([b"a", b"\x92\x01\x02"])

    worker.request("after", [5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)

    assert len(_tokens(worker.outputs("after"))) == 3
    assert worker.process.poll() is None


def test_sigterm_fails_in_flight_requests_and_exits_0(fresh_worker: Worker) -> None:
    worker = fresh_worker
    worker.request("cut", _prompt(8), max_tokens=1500, temperature=0.0, ignore_eos=True)
    worker.next_batch()

    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)

    assert worker.process.wait(10) == 0
    assert time.monotonic() - started < 5
    error = worker.error("cut")
    assert (error.status, error.code) == (503, "server_error")
    assert worker.finished("cut") == RequestFinished("cut", WORKER_ID)
    assert worker.scheduler.take(lambda m: isinstance(m, WorkerGone)) == WorkerGone(WORKER_ID)
    assert worker.index.take(lambda m: isinstance(m, WorkerGone)) == WorkerGone(WORKER_ID)


def test_a_tensor_parallel_worker_answers_with_the_single_rank_tokens() -> None:
    """--tensor-parallel-size 2 on the CPU: this process is rank 0, rank 1 a spawned follower (gloo)."""
    import psutil

    prompt = _prompt(37, seed=4)
    with _running_worker("--tensor-parallel-size", "2") as worker:
        followers = psutil.Process(worker.process.pid).children(recursive=True)
        worker.request("tp", prompt, max_tokens=9, temperature=0.0, ignore_eos=True)
        outputs = worker.outputs("tp")
        assert worker.finished("tp") == RequestFinished("tp", WORKER_ID)
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(30) == 0
    expected = _engine().generate([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert _tokens(outputs) == expected[0].samples[0].token_ids
    assert followers and not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in followers)
