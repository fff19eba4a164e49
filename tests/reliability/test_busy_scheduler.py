"""Busy is not dead: a real tokenizer process whose only scheduler (a fake ROUTER over ipc://) stops answering
its pings for longer than --scheduler-timeout-s while it holds a queued request. The request waits for it, is
never re-sent to one that answers again as the same incarnation, is re-sent once to one that restarted, and fails
with 503 only after --scheduler-give-up-s or when the scheduler's socket goes away."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.messages import (GatewayInbound, GenerateChunk, GenerateError, GenerateRequest, SamplingSpec,
                             StatusReply, StatusRequest, TokenBatch, TokenizedRequest,
                             TokenOutputs, encode)
from tests.reliability.cluster import MODEL, ROOT, RouterThread, wait_until
from tests.service.test_tokenizer_service import Inbox

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PING_INTERVAL_S = 0.1
SCHEDULER_TIMEOUT_S = 0.5
WAIT_S = 30.0  # for any one thing to happen (the tokenizer's start included)
GONE = "the scheduler holding the request is gone and it could not be re-sent"


class FakeScheduler:
    """A scheduler ROUTER served by a thread: it answers StatusRequest pings as `incarnation` while `is_answering`,
    counts the pings, and keeps every TokenizedRequest it is sent (it routes nothing)."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.is_answering = True
        self.incarnation = "inc-1"
        self.num_pings = 0
        self.requests: list[TokenizedRequest] = []
        self._router = RouterThread(ctx, addr, self._on_message, poll_ms=20)

    def _on_message(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, StatusRequest):
            self.num_pings += 1
            if self.is_answering:
                self._router.send(identity, StatusReply([MODEL], num_workers=1, num_queued=len(self.requests),
                                                        num_in_flight=0, incarnation=self.incarnation))
        elif isinstance(msg, TokenizedRequest):
            self.requests.append(msg)

    def copies(self, request_id: str) -> int:
        return sum(r.request_id == request_id for r in self.requests)

    def wait_pings(self, num_pings: int) -> None:
        """Until num_pings more pings came: each follows a full pass of the tokenizer's liveness checks."""
        target = self.num_pings + num_pings
        wait_until(lambda: self.num_pings >= target, WAIT_S)

    def close(self) -> None:
        """Stop and close the socket: the tokenizer's DEALER is no longer connected to it."""
        self._router.close(5)


@dataclass
class Tokenizer:
    process: subprocess.Popen
    log_path: Path
    gateway: Inbox
    scheduler: FakeScheduler
    worker: zmq.Socket

    def events(self, event: str) -> list[dict[str, Any]]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [e for e in (json.loads(line) for line in lines if line.startswith("{")) if e.get("event") == event]

    def generate(self, request_id: str) -> None:
        self.gateway.sock.send(encode(GenerateRequest(request_id, prompt_token_ids=[1, 2, 3],
                                                      sampling=SamplingSpec(max_tokens=3))))
        wait_until(lambda: self.scheduler.copies(request_id), WAIT_S)

    def go_silent_until_lost(self) -> None:
        """The scheduler stops answering until the tokenizer has lost it and acted on the loss."""
        self.scheduler.is_answering = False
        wait_until(lambda: self.events("scheduler lost"), WAIT_S)
        assert [e["reason"] for e in self.events("scheduler lost")] == ["stopped answering"]
        self.scheduler.wait_pings(3)

    def answer_again(self, incarnation: str) -> None:
        self.scheduler.incarnation, self.scheduler.is_answering = incarnation, True
        wait_until(lambda: self.events("scheduler live"), WAIT_S)
        self.scheduler.wait_pings(3)

    def stream(self, request_id: str, token_ids: list[int]) -> Any:
        """The worker streams the whole answer; what the gateway gets for it."""
        out = TokenOutputs(request_id, 0, token_ids, None, "length", num_prompt_tokens=3, num_cached_tokens=0)
        self.worker.send(encode(TokenBatch("w0", [out])))
        return self.gateway.take(lambda m: m.request_id == request_id, WAIT_S)

    def answers_meanwhile(self, request_id: str) -> list[Any]:
        """What the gateway gets for request_id until nothing came for half a second."""
        return self.gateway.take_all(lambda m: m.request_id == request_id)


@contextmanager
def tokenizer(log_dir: Path, give_up_s: float) -> Iterator[Tokenizer]:
    """A tokenizer process (random:tiny-llama: token-id prompts) pinging a fake scheduler every 0.1 s and losing
    it after 0.5 s of silence; a gateway DEALER and a worker PUSH beside it."""
    ipc_dir = Path(tempfile.mkdtemp(prefix="rsbusy"))  # short: ipc:// paths are limited to ~100 bytes
    ctx = zmq.Context()
    addrs = {name: f"ipc://{ipc_dir / name}" for name in ("tok", "stream", "sched")}
    scheduler = FakeScheduler(ctx, addrs["sched"])
    gateway = Inbox(ctx.socket(zmq.DEALER), GatewayInbound)
    worker = ctx.socket(zmq.PUSH)
    for sock in (gateway.sock, worker):
        sock.setsockopt(zmq.LINGER, 0)
    gateway.sock.connect(addrs["tok"])
    worker.connect(addrs["stream"])
    log_path = log_dir / "tokenizer.log"
    argv = [sys.executable, "-m", "services.tokenizer", "--model", MODEL, "--tokenizer-addr", addrs["tok"],
            "--stream-addr", addrs["stream"], "--scheduler-addrs", addrs["sched"],
            "--scheduler-ping-interval-s", str(PING_INTERVAL_S), "--scheduler-timeout-s", str(SCHEDULER_TIMEOUT_S),
            "--scheduler-give-up-s", str(give_up_s)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "RADIXSERVE_LOG_JSON": "1"})
    try:
        wait_until(lambda: scheduler.num_pings >= 3, WAIT_S)
        yield Tokenizer(process, log_path, gateway, scheduler, worker)
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        scheduler.close()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_a_silent_scheduler_that_answers_again_keeps_its_request_and_gets_it_once(tmp_path: Path) -> None:
    with tokenizer(tmp_path, give_up_s=600) as t:
        t.generate("q-1")
        t.go_silent_until_lost()
        assert t.answers_meanwhile("q-1") == []  # neither failed nor re-sent while it is silent
        assert t.scheduler.copies("q-1") == 1
        t.answer_again("inc-1")
        assert [e["num_requests"] for e in t.events("scheduler answers again; its requests were kept")] == [1]
        chunk = t.stream("q-1", [7, 8, 9])
        assert isinstance(chunk, GenerateChunk) and (chunk.token_ids, chunk.finish_reason) == ([7, 8, 9], "length")
        t.scheduler.wait_pings(3)
        assert t.scheduler.copies("q-1") == 1
        assert t.events("request re-sent") == [] and t.events("silent scheduler given up") == []


def test_a_silent_scheduler_that_comes_back_restarted_gets_the_request_again_once(tmp_path: Path) -> None:
    with tokenizer(tmp_path, give_up_s=600) as t:
        t.generate("q-2")
        t.go_silent_until_lost()
        assert t.answers_meanwhile("q-2") == []
        t.answer_again("inc-2")
        wait_until(lambda: t.scheduler.copies("q-2") == 2, WAIT_S)
        chunk = t.stream("q-2", [4, 5, 6])
        assert isinstance(chunk, GenerateChunk) and (chunk.token_ids, chunk.finish_reason) == ([4, 5, 6], "length")
        t.scheduler.wait_pings(3)
        assert t.scheduler.copies("q-2") == 2
        assert [(e["request_id"], e["reason"]) for e in t.events("request re-sent")] == [
            ("q-2", "its scheduler is gone")]


def test_a_scheduler_silent_past_the_give_up_time_fails_its_request_with_503(tmp_path: Path) -> None:
    with tokenizer(tmp_path, give_up_s=5) as t:
        t.generate("q-3")
        t.go_silent_until_lost()
        assert t.answers_meanwhile("q-3") == []
        error = t.gateway.take(lambda m: m.request_id == "q-3", WAIT_S)
        assert isinstance(error, GenerateError) and error.status == 503 and error.message.startswith(GONE)
        assert [(e["reason"], e["num_requests"]) for e in t.events("silent scheduler given up")] == [
            ("silent for scheduler_give_up_s (5.0 s)", 1)]
        assert t.scheduler.copies("q-3") == 1


def test_a_silent_scheduler_whose_socket_goes_away_fails_its_request_at_once(tmp_path: Path) -> None:
    with tokenizer(tmp_path, give_up_s=600) as t:  # NOTE: far past WAIT_S: only the lost socket can end it
        t.generate("q-4")
        t.go_silent_until_lost()
        assert t.answers_meanwhile("q-4") == []
        t.scheduler.close()
        error = t.gateway.take(lambda m: m.request_id == "q-4", WAIT_S)
        assert isinstance(error, GenerateError) and error.status == 503 and error.message.startswith(GONE)
        assert [(e["reason"], e["num_requests"]) for e in t.events("silent scheduler given up")] == [
            ("unreachable", 1)]
