"""The gpu_worker's engine thread without sockets: commands in, ordered envelopes out, and recovery from
an engine that raises in the middle of a step."""
from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.engine_loop import (AbortCommand, AddCommand, EngineLoop, Envelope, SnapshotCommand,
                                             WorkerIdentity)
from shared.messages import (CacheSnapshot, GenerateError, KVEventBatch, RequestFinished, SamplingSpec, TokenBatch,
                             TokenizedRequest)

REPLY = "ipc://tokenizer"
INDEX = "ipc://index"
IDENTITY = WorkerIdentity("w0", "ipc://w0", "inc-1", INDEX)


@pytest.fixture(params=[False, True], ids=["serial", "overlap"])
def loop(request: pytest.FixtureRequest) -> Iterator[tuple[EngineLoop, queue.SimpleQueue]]:
    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", page_size=4,
                                 num_pages=64, enable_overlap=request.param))
    delivered: queue.SimpleQueue[Envelope] = queue.SimpleQueue()
    engine_loop = EngineLoop(engine, IDENTITY, lambda envs: [delivered.put(e) for e in envs], clock=lambda: 100.0)
    engine_loop.start()
    yield engine_loop, delivered
    assert engine_loop.stop(10.0)


def _request(request_id: str, max_tokens: int = 3, deadline_s: float | None = None) -> TokenizedRequest:
    return TokenizedRequest(request_id, list(range(5, 14)), [], SamplingSpec(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True),
                            REPLY, 99.0, deadline_s)


def _until_finished(delivered: queue.SimpleQueue, request_id: str) -> list[Envelope]:
    envelopes = []
    while True:
        envelope = delivered.get(timeout=30)
        envelopes.append(envelope)
        if envelope.msg == RequestFinished(request_id, "w0"):
            return envelopes


def test_a_request_streams_then_finishes_with_kv_events(loop) -> None:
    engine_loop, delivered = loop
    engine_loop.submit(AddCommand(_request("r1")))

    envelopes = _until_finished(delivered, "r1")

    batches = [e for e in envelopes if isinstance(e.msg, TokenBatch)]
    assert {e.addr for e in batches} == {REPLY}
    assert [o.finish_reason for b in batches for o in b.msg.outputs] == [None, None, "length"]
    assert envelopes[-1].addr is None  # to every scheduler
    engine_loop.submit(SnapshotCommand(INDEX))
    events = [e for e in envelopes if isinstance(e.msg, KVEventBatch)]
    snapshot = delivered.get(timeout=30)
    assert {e.addr for e in events} == {INDEX}
    assert snapshot == Envelope(INDEX, CacheSnapshot("w0", "inc-1", sum(len(e.msg.events) for e in events),
                                                     list(engine_loop.engine.cache.cached_blocks())))


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_loop_serves_on(loop, monkeypatch) -> None:
    engine_loop, delivered = loop
    real_step = engine_loop.engine.step
    monkeypatch.setattr(engine_loop.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("CUDA OOM")))
    engine_loop.submit(AddCommand(_request("doomed", max_tokens=50)))

    envelopes = _until_finished(delivered, "doomed")
    monkeypatch.setattr(engine_loop.engine, "step", real_step)
    engine_loop.submit(AddCommand(_request("after")))
    after = _until_finished(delivered, "after")

    assert [e.msg for e in envelopes] == [
        GenerateError("doomed", 500, "server_error", "the worker's engine failed"),
        RequestFinished("doomed", "w0")]
    assert [o.finish_reason for e in after if isinstance(e.msg, TokenBatch) for o in e.msg.outputs][-1] == "length"
    assert engine_loop.engine.pool.num_free + engine_loop.engine.cache.num_cached_pages == 63


def test_an_expired_deadline_is_rejected_with_504(loop) -> None:
    engine_loop, delivered = loop
    engine_loop.submit(AddCommand(_request("late", deadline_s=99.5)))

    envelopes = _until_finished(delivered, "late")

    assert [e.msg for e in envelopes] == [
        GenerateError("late", 504, "timeout", "the request's deadline passed before it started"),
        RequestFinished("late", "w0")]


def test_abort_of_an_unknown_request_sends_nothing(loop) -> None:
    engine_loop, delivered = loop
    engine_loop.submit(AbortCommand("nobody"))
    engine_loop.submit(AddCommand(_request("r2", max_tokens=1)))

    envelopes = _until_finished(delivered, "r2")

    assert {type(e.msg) for e in envelopes} <= {TokenBatch, KVEventBatch, RequestFinished}


def test_sampling_out_of_its_bounds_gets_400_from_the_struct_check(loop) -> None:
    engine_loop, delivered = loop
    request = TokenizedRequest("bad", [5, 6], [], SamplingSpec(top_p=0.0), REPLY, 99.0)
    engine_loop.submit(AddCommand(request))

    envelopes = _until_finished(delivered, "bad")

    assert [e.msg for e in envelopes if isinstance(e.msg, GenerateError)] == [GenerateError(
        "bad", 400, "invalid_request_error",
        "Invalid 'top_p': decimal below minimum value. Expected a value > 0, but got 0.0 instead.",
        error_code="decimal_below_min_value", param="top_p")]
