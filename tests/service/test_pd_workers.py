"""A prefill worker and a decode worker as real processes over ipc://, with a fake scheduler and tokenizer:
the KV handoff by reference (shm and stream backends), partial pulls, leases, aborts and a dead source."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from services.gpu_worker.request import SamplingParams
from shared.hashing import hash_blocks
from shared.messages import (AbortRequest, HandoffAccepted, KVReady, KVSource, PrefillRequest, RequestFinished,
                             SamplingSpec, SchedulerInbound, TokenBatch, TokenizedRequest, TokenizerStreamInbound,
                             TokenOutputs, WorkerHeartbeat, encode)
from tests.service.test_gpu_worker_service import MODEL, NUM_PAGES, PAGE, ROOT, Inbox, _bind, _engine, _prompt

pytestmark = pytest.mark.slow


@dataclass
class Pair:
    """A prefill worker "p" and a decode worker "d" sharing one fake scheduler and one fake tokenizer."""

    procs: dict[str, subprocess.Popen]
    addrs: dict[str, str]
    scheduler: Inbox
    stream: Inbox
    pushes: dict[str, zmq.Socket]
    received: dict[str, list[tuple[str, TokenOutputs]]] = field(default_factory=dict)

    def send(self, worker: str, msg: Any) -> None:
        self.pushes[worker].send(encode(msg))

    def tokenized(self, request_id: str, prompt: list[int], **sampling: Any) -> TokenizedRequest:
        return TokenizedRequest(request_id, prompt, hash_blocks(prompt, PAGE, MODEL), SamplingSpec(**sampling),
                                self.addrs["stream"], time.time())

    def prefill(self, request_id: str, prompt: list[int], decode_addr: str | None = None, **sampling: Any) -> None:
        request = self.tokenized(request_id, prompt, **sampling)
        self.send("p", PrefillRequest(request, "d", decode_addr or self.addrs["d"]))

    def outputs(self, request_id: str) -> list[tuple[str, TokenOutputs]]:
        """(worker_id, output) of request_id until it finished, in arrival order."""
        while not any(o.finish_reason for _, o in self.received.get(request_id, [])):
            batch = self.stream.take(lambda m: isinstance(m, TokenBatch))
            for out in batch.outputs:
                self.received.setdefault(out.request_id, []).append((batch.worker_id, out))
        return self.received.pop(request_id)

    def heartbeat(self, worker_id: str, match=lambda hb: True, timeout_s: float = 60.0) -> WorkerHeartbeat:
        return self.scheduler.take(lambda m: isinstance(m, WorkerHeartbeat) and m.worker_id == worker_id
                                   and match(m), timeout_s=timeout_s, after=self.scheduler.now())

    def idle(self, worker_id: str, **transfer: int) -> WorkerHeartbeat:
        """The first heartbeat with nothing running or leased and every used page in the radix cache."""
        def is_idle(hb: WorkerHeartbeat) -> bool:
            load = hb.load
            counters = hb.transfer
            return (load.num_running == load.num_waiting == load.num_leased_pages == 0
                    and load.num_total_pages - load.num_free_pages == load.num_cached_pages
                    and all(getattr(counters, k) == v for k, v in transfer.items()))
        return self.heartbeat(worker_id, is_idle, timeout_s=30.0)


@contextlib.contextmanager
def _running_pair(kv_transfer: str, lease_ttl_s: float = 30.0) -> Iterator[Pair]:
    ipc_dir = Path(tempfile.mkdtemp(prefix="rspd"))
    ctx = zmq.Context()
    addrs = {name: f"ipc://{ipc_dir / name}" for name in ("p", "d", "sched", "stream", "pages")}
    scheduler = Inbox(_bind(ctx, zmq.ROUTER, addrs["sched"]), SchedulerInbound, has_identity=True)
    stream = Inbox(_bind(ctx, zmq.PULL, addrs["stream"]), TokenizerStreamInbound)
    common = ["--scheduler-addrs", addrs["sched"], "--model", MODEL, "--device", "cpu", "--page-size", str(PAGE),
              "--num-pages", str(NUM_PAGES), "--heartbeat-interval-s", "0.1", "--kv-transfer", kv_transfer]
    argv = {"p": ["--role", "prefill", "--transfer-addr", addrs["pages"], "--lease-ttl-s", str(lease_ttl_s)],
            "d": ["--role", "decode"]}
    procs = {w: subprocess.Popen([sys.executable, "-m", "services.gpu_worker", "--worker-id", w, "--worker-addr",
                                  addrs[w], *common, *argv[w]], cwd=ROOT, env={**os.environ, "RADIXSERVE_LOG_JSON": "1"})
             for w in ("p", "d")}
    pushes = {}
    for w in ("p", "d"):
        pushes[w] = ctx.socket(zmq.PUSH)
        pushes[w].setsockopt(zmq.LINGER, 0)
        pushes[w].connect(addrs[w])
    pair = Pair(procs, addrs, scheduler, stream, pushes)
    try:
        pair.heartbeat("p")
        pair.heartbeat("d")
        yield pair
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


@pytest.fixture(scope="module", params=["shm", "stream"])
def pair(request) -> Iterator[Pair]:
    with _running_pair(request.param) as handle:
        yield handle


def _greedy(prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return _engine().generate([prompt], params)[0].samples[0].token_ids


def _pages(num_tokens: int) -> int:
    return -(-num_tokens // PAGE)


def test_pd_output_equals_colocated_and_the_first_token_comes_from_prefill(pair: Pair) -> None:
    before = pair.heartbeat("d").transfer
    prompt = _prompt(37, seed=11)
    pair.prefill("pd-eq", prompt, max_tokens=9, temperature=0.0, ignore_eos=True)

    outputs = pair.outputs("pd-eq")

    assert [t for _, o in outputs for t in o.token_ids] == _greedy(prompt, 9)
    assert [w for w, _ in outputs] == ["p"] + ["d"] * 8
    assert [o.finish_reason for _, o in outputs] == [None] * 8 + ["length"]
    finished = [pair.scheduler.take(lambda m, w=w: isinstance(m, RequestFinished) and m.worker_id == w)
                for w in ("p", "d")]
    assert finished == [RequestFinished("pd-eq", "p", handed_off=True), RequestFinished("pd-eq", "d")]
    assert pair.scheduler.take(lambda m: isinstance(m, HandoffAccepted)) == HandoffAccepted("pd-eq", "d")
    after = pair.idle("d", num_imports=before.num_imports + 1).transfer
    assert after.num_pages_pulled - before.num_pages_pulled == _pages(37)
    assert pair.idle("p").transfer.num_leases == 0


def test_decode_pulls_only_the_pages_its_own_cache_lacks(pair: Pair) -> None:
    base = _prompt(40, seed=12)
    pair.prefill("warm", base, max_tokens=2, temperature=0.0, ignore_eos=True)
    pair.outputs("warm")
    before = pair.idle("d").transfer
    prompt = base[:32] + _prompt(9, seed=13)  # 8 leading full pages held by d; 41 tokens = 11 pages

    pair.prefill("partial", prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs = pair.outputs("partial")

    assert [t for _, o in outputs for t in o.token_ids] == _greedy(prompt, 5)
    after = pair.idle("d", num_imports=before.num_imports + 1).transfer
    assert after.num_pages_reused - before.num_pages_reused == 8
    assert after.num_pages_pulled - before.num_pages_pulled == _pages(41) - 8


def test_abort_after_the_handoff_frees_both_sides(pair: Pair) -> None:
    prompt = _prompt(30, seed=14)
    pair.prefill("pd-abort", prompt, max_tokens=2000, temperature=0.0, ignore_eos=True)
    pair.stream.take(lambda m: isinstance(m, TokenBatch) and any(
        o.request_id == "pd-abort" for o in m.outputs) and m.worker_id == "d")
    for worker in ("p", "d"):
        pair.send(worker, AbortRequest("pd-abort"))

    outputs = pair.outputs("pd-abort")

    assert outputs[-1][1].finish_reason == "abort"
    pair.idle("d")
    assert pair.idle("p").transfer.num_leases == 0


def test_a_dead_source_makes_decode_recompute_the_prompt(pair: Pair) -> None:
    prompt = _prompt(23, seed=15)
    expected = _greedy(prompt, 6)
    request = pair.tokenized("orphan", prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    gone = KVSource("elsewhere", "cpu", 2, NUM_PAGES, PAGE, 2, 16, "float32",  # tiny-llama's layout
                    stream_addr=pair.addrs["stream"] + "-nobody")
    before = pair.heartbeat("d").transfer
    pair.send("d", KVReady(request, expected[0], None, 0, list(range(1, 1 + _pages(23))), gone, "p-dead",
                           pair.addrs["p"] + "-dead", "lease-x", time.time() + 1.0))

    outputs = pair.outputs("orphan")

    assert [t for _, o in outputs for t in o.token_ids] == expected[1:]
    assert pair.idle("d").transfer.num_import_fallbacks == before.num_import_fallbacks + 1


def test_lease_expires_when_the_decode_worker_never_pulls() -> None:
    with _running_pair("auto", lease_ttl_s=1.5) as pair:
        silent = pair.addrs["stream"] + "-silent-d"
        sink = zmq.Context.instance().socket(zmq.PULL)
        sink.setsockopt(zmq.LINGER, 0)
        sink.bind(silent)
        try:
            pair.prefill("stranded", _prompt(33, seed=16), decode_addr=silent, max_tokens=8, temperature=0.0,
                         ignore_eos=True)
            first = pair.stream.take(lambda m: isinstance(m, TokenBatch))
            assert first.worker_id == "p" and first.outputs[0].finish_reason is None
            held = pair.heartbeat("p", lambda hb: hb.load.num_leased_pages > 0)
            assert held.load.num_leased_pages == _pages(33)
            assert sink.poll(10_000)
            pair.idle("p", num_leases_expired=1)
        finally:
            sink.close(linger=0)


@pytest.mark.parametrize("kv_transfer", ["shm", "stream"])
def test_a_killed_prefill_worker_leaves_decode_exact_and_without_leaks(kv_transfer: str) -> None:
    with _running_pair(kv_transfer) as pair:
        prompt = _prompt(45, seed=17)
        pair.prefill("survivor", prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        first = pair.stream.take(lambda m: isinstance(m, TokenBatch) and m.worker_id == "p")
        pair.scheduler.take(lambda m: isinstance(m, HandoffAccepted))  # d holds the KVReady
        pair.procs["p"].kill()  # the pull races the death

        rest = pair.outputs("survivor")

        tokens = first.outputs[0].token_ids + [t for _, o in rest for t in o.token_ids]
        assert tokens == _greedy(prompt, 12)
        counters = pair.idle("d").transfer
        assert counters.num_imports + counters.num_import_fallbacks == 1
