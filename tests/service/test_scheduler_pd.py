"""The scheduler process pairing PD requests among fake prefill/decode workers: PrefillRequest to the prefill
worker naming the decode worker, both legs tracked until the handoff, aborts to both legs, and a dead
prefill worker failing its request cleanly (503) while the decode worker is told to abort."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shared.messages import (AbortRequest, GenerateError, HandoffAccepted, PrefillRequest, RequestFinished,
                             SamplingSpec, TokenizedRequest, WorkerHeartbeat, encode)
from tests.service.test_scheduler_service import HEARTBEAT_TIMEOUT_S, FakeWorker, Rig, load, start_rig

pytestmark = pytest.mark.slow


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from start_rig("--pd-policy", "auto", "--pd-min-prefill-tokens", "64")


def beat(worker: FakeWorker, role: str) -> None:
    for dealer in worker.dealers:
        dealer.send(encode(WorkerHeartbeat(worker.worker_id, worker.incarnation, worker.addr, worker.model_id, role,
                                           16, load())))


def say(worker: FakeWorker, msg) -> None:
    for dealer in worker.dealers:
        dealer.send(encode(msg))


def request(rig: Rig, request_id: str, num_tokens: int) -> None:
    rig.tokenizer.send(encode(TokenizedRequest(request_id, list(range(num_tokens)), [], SamplingSpec(),
                                               rig.reply_addr, time.time())))


def pd_pair(rig: Rig) -> tuple[FakeWorker, FakeWorker]:
    p, d = rig.worker("p0"), rig.worker("d0")
    beat(p, "prefill")
    beat(d, "decode")
    rig.wait_status(lambda s: s.num_workers == 2)
    return p, d


def test_long_prompts_are_split_and_short_ones_stay_on_the_decode_worker(rig: Rig) -> None:
    p, d = pd_pair(rig)
    request(rig, "long", 64)
    request(rig, "short", 63)

    sent = p.inbox.take()
    assert isinstance(sent, PrefillRequest)
    assert (sent.request.request_id, sent.decode_worker_id, sent.decode_addr) == ("long", "d0", d.addr)
    assert d.received_ids() == [("TokenizedRequest", "short")]
    assert rig.wait_status(lambda s: s.num_in_flight == 2).num_in_flight == 2
    say(p, RequestFinished("long", "p0", handed_off=True))
    say(d, HandoffAccepted("long", "d0"))  # the prefill leg closes; the request goes on
    say(d, RequestFinished("short", "d0"))
    assert rig.wait_status(lambda s: s.num_in_flight == 1).num_in_flight == 1
    say(d, RequestFinished("long", "d0"))
    rig.wait_status(lambda s: s.num_in_flight == 0)


def test_abort_reaches_both_legs(rig: Rig) -> None:
    p, d = pd_pair(rig)
    request(rig, "ab", 100)
    assert isinstance(p.inbox.take(), PrefillRequest)
    rig.abort("ab")
    assert p.received_ids() == [("AbortRequest", "ab")]
    assert d.received_ids() == [("AbortRequest", "ab")]
    rig.wait_status(lambda s: s.num_in_flight == 0)


@pytest.mark.parametrize("is_accepted", [False, True])
def test_a_dead_prefill_worker_fails_its_request_unless_the_decode_side_accepted_it(rig: Rig,
                                                                                    is_accepted: bool) -> None:
    p, d = pd_pair(rig)
    request(rig, "orphan", 100)
    assert isinstance(p.inbox.take(), PrefillRequest)
    say(p, RequestFinished("orphan", "p0", handed_off=True))  # its KVReady may still be lost
    if is_accepted:
        say(d, HandoffAccepted("orphan", "d0"))
    deadline = time.monotonic() + 4 * HEARTBEAT_TIMEOUT_S
    while time.monotonic() < deadline:  # d stays alive, p falls silent
        beat(d, "decode")
        time.sleep(0.05)
        if rig.status().num_workers == 1:
            break

    if is_accepted:  # d still holds the request (checked while d is alive: its heartbeats stop here)
        assert rig.status().num_in_flight == 1
        beat(d, "decode")
        assert rig.errors.take_all(0.3) == [] and d.inbox.take_all(0.3) == []
        return
    error = rig.errors.take()
    assert isinstance(error, GenerateError) and (error.request_id, error.status) == ("orphan", 503)
    assert [(type(m), m.request_id) for m in d.inbox.take_all(0.5)] == [(AbortRequest, "orphan")]
    assert rig.status().num_in_flight == 0


def test_a_prefill_worker_that_finishes_the_request_itself_closes_it(rig: Rig) -> None:
    p, _ = pd_pair(rig)
    request(rig, "one", 100)
    assert isinstance(p.inbox.take(), PrefillRequest)
    say(p, RequestFinished("one", "p0"))  # e.g. the first token was EOS: no handoff
    rig.wait_status(lambda s: s.num_in_flight == 0)
