"""The engine's PD hooks in one process: a prefill engine holds a prompt's pages, a decode engine imports
them (through the shared-memory backend) and continues; outputs equal the colocated engine's, exactly.
Then the engine thread's side of the handoff: KVReady after the first token, leases released or expired."""
from __future__ import annotations

import queue
import random
import time
import uuid

import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.engine_loop import EngineLoop, Envelope, PrefillCommand, ReleaseCommand, WorkerIdentity
from services.gpu_worker.handoff import HandoffSettings
from services.gpu_worker.kv_transfer.export import export_pool
from services.gpu_worker.kv_transfer.shm import ShmPuller
from services.gpu_worker.request import FinishReason, SamplingParams
from shared.messages import (KVReady, KVSource, PrefillRequest, ReleaseLease, RequestFinished, SamplingSpec,
                             TokenBatch, TokenizedRequest)

PAGE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(overlap: bool = False) -> Engine:
    return Engine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", page_size=PAGE,
                               num_pages=64, enable_overlap=overlap))


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(length)]


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def engines(request: pytest.FixtureRequest):
    prefill, decode, colocated = (_engine(request.param) for _ in range(3))
    exported = export_pool(prefill.kv, "host", f"rs-test-{uuid.uuid4().hex[:8]}", "")
    yield prefill, decode, colocated, exported.source
    exported.close()


def _prefill(engine: Engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, GREEDY, is_prefill_only=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (handoff,) = engine.drain_handoffs()
    assert [o.finish_reason for o in outputs] == [None] and outputs[0].token_ids == [handoff.first_token]
    return handoff


def _decode(engine: Engine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == request_id for t in o.token_ids]
    return tokens


def _leaks(engine: Engine) -> int:
    stats = engine.stats()
    return stats.num_total_pages - stats.num_free_pages - stats.num_cached_pages


def test_imported_request_decodes_exactly_like_the_colocated_one_and_pulls_only_missing_pages(engines) -> None:
    prefill, decode, colocated, source = engines
    puller = ShmPuller()
    first = _prompt(30, seed=1)  # 8 pages, the last partial
    second = first[:24] + _prompt(9, seed=2)  # 33 tokens = 9 pages; 6 full pages shared with the first
    for request_id, prompt, num_reused in (("a", first, 0), ("b", second, 6)):
        handoff = _prefill(prefill, request_id, prompt)
        plan = decode.import_request(request_id, prompt, handoff.first_token, GREEDY)
        assert plan.num_reused_pages == num_reused and len(plan.page_ids) == -(-len(prompt) // PAGE)
        indices = plan.page_indices_to_fill
        puller.pull(source, "lease", [handoff.page_ids[i] for i in indices], [plan.page_ids[i] for i in indices],
                    decode.kv)
        assert decode.finish_import(request_id, is_filled=True)
        prefill.release_held(request_id)

        tokens = [handoff.first_token] + _decode(decode, request_id)

        assert tokens == colocated.generate([prompt], GREEDY)[0].samples[0].token_ids
    assert _leaks(prefill) == _leaks(decode) == 0


def test_failed_pull_recomputes_and_abort_during_import_frees_pages_only_at_the_end(engines) -> None:
    prefill, decode, colocated, _ = engines
    prompt = _prompt(21, seed=3)
    expected = colocated.generate([prompt], GREEDY)[0].samples[0].token_ids
    plan = decode.import_request("fail", prompt, expected[0], GREEDY)
    assert plan.page_indices_to_fill
    assert decode.finish_import("fail", is_filled=False)  # nothing was copied: recompute here
    assert [expected[0]] + _decode(decode, "fail") == expected

    prompt = _prompt(17, seed=4)
    plan = decode.import_request("gone", prompt, 7, GREEDY)
    free_during = decode.stats().num_free_pages
    (out,) = decode.abort("gone")
    assert out.finish_reason is FinishReason.ABORT
    assert decode.stats().num_free_pages == free_during  # a pull may still be writing into them
    assert not decode.finish_import("gone", is_filled=True)
    assert _leaks(decode) == 0 and not decode.has_unfinished()


def test_prompt_logprobs_come_from_the_prefill_worker_only(engines) -> None:
    prefill, decode, colocated, _ = engines
    prompt, params = _prompt(21, seed=5), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                         prompt_logprobs=2)
    want = colocated.generate([prompt], params)[0].prompt_logprobs
    prefill.add_request("pl", prompt, params, is_prefill_only=True)
    outputs = []
    while prefill.has_unfinished():
        outputs += prefill.step()
    (first,) = outputs
    assert [(e.token_id, e.rank) for e in first.prompt_logprobs[1:]] == [(e.token_id, e.rank) for e in want[1:]]
    assert [e.logprob for e in first.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in want[1:]], abs=1e-5)
    (handoff,) = prefill.drain_handoffs()
    prefill.release_held("pl")
    decode.import_request("pl", prompt, handoff.first_token, params)
    assert decode.finish_import("pl", is_filled=False)  # recomputes the prompt here, and still sends none
    outputs = []
    while decode.has_unfinished():
        outputs += decode.step()
    outputs += decode.flush()
    assert sum(len(o.token_ids) for o in outputs) == 2 and all(o.prompt_logprobs is None for o in outputs)


def test_abort_releases_held_pages(engines) -> None:
    prefill = engines[0]
    _prefill(prefill, "held", _prompt(19, seed=5))
    assert _leaks(prefill) == 1  # the partial last page is held by the request alone
    assert prefill.abort("held") == []
    assert _leaks(prefill) == 0 and not prefill.release_held("held")


# --- the engine thread's handoff (no sockets) -----------------------------------------------------------

SOURCE = KVSource("host", "cpu", 2, 64, PAGE, 2, 16, "float32", stream_addr="ipc://pages")


def _loop(source: KVSource | None, now: list[float], overlap: bool) -> tuple[EngineLoop, queue.SimpleQueue]:
    delivered: queue.SimpleQueue[Envelope] = queue.SimpleQueue()
    settings = HandoffSettings("p0", "ipc://p0", "host", lease_ttl_s=5.0, source=source)
    engine_loop = EngineLoop(_engine(overlap), WorkerIdentity("p0", "ipc://p0", "inc", ""),
                             lambda envs: [delivered.put(e) for e in envs], clock=lambda: now[0], handoff=settings)
    engine_loop.start()
    return engine_loop, delivered


def _prefill_request(request_id: str) -> PrefillRequest:
    request = TokenizedRequest(request_id, _prompt(18, seed=6), [], SamplingSpec(max_tokens=4, temperature=0.0,
                                                                                 ignore_eos=True), "ipc://tok", 0.0)
    return PrefillRequest(request, "d0", "ipc://d0")


def _take_until(delivered: queue.SimpleQueue, match) -> list[Envelope]:
    taken = []
    while not taken or not match(taken[-1].msg):
        taken.append(delivered.get(timeout=30))
    return taken


def _pool_is_clean(engine_loop: EngineLoop) -> bool:
    load = engine_loop.load
    return load.num_leased_pages == 0 and load.num_total_pages - load.num_free_pages == load.num_cached_pages


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_prefill_hands_off_after_the_first_token_and_frees_on_release_or_expiry(overlap: bool) -> None:
    now = [100.0]
    engine_loop, delivered = _loop(SOURCE, now, overlap)
    try:
        engine_loop.submit(PrefillCommand(_prefill_request("h1")))
        envelopes = _take_until(delivered, lambda m: isinstance(m, RequestFinished))
        assert [(e.addr, type(e.msg)) for e in envelopes] == [("ipc://tok", TokenBatch), ("ipc://d0", KVReady),
                                                              (None, RequestFinished)]
        ready = envelopes[1].msg
        assert envelopes[0].msg.outputs[0].token_ids == [ready.first_token]
        assert (len(ready.page_ids), ready.lease_expires_s, ready.source) == (5, 105.0, SOURCE)
        assert envelopes[2].msg == RequestFinished("h1", "p0", handed_off=True)
        engine_loop.submit(ReleaseCommand(ReleaseLease(ready.lease_id, "h1", 5)))

        engine_loop.submit(PrefillCommand(_prefill_request("h2")))
        _take_until(delivered, lambda m: isinstance(m, RequestFinished))
        assert engine_loop.load.num_leased_pages == 5  # h2's, held; h1's were released
        now[0] = 106.0  # past h2's lease: the idle engine thread wakes up for it

        deadline_s = time.monotonic() + 20
        while not _pool_is_clean(engine_loop) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert _pool_is_clean(engine_loop) and engine_loop.transfer.num_leases_expired == 1
        assert engine_loop.transfer.num_handoffs == 2
    finally:
        assert engine_loop.stop(10.0)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_worker_without_an_exported_pool_runs_a_prefill_request_whole(overlap: bool) -> None:
    engine_loop, delivered = _loop(None, [100.0], overlap)
    try:
        engine_loop.submit(PrefillCommand(_prefill_request("whole")))
        envelopes = _take_until(delivered, lambda m: isinstance(m, RequestFinished))
        tokens = [t for e in envelopes if isinstance(e.msg, TokenBatch) for o in e.msg.outputs for t in o.token_ids]
        assert len(tokens) == 4 and envelopes[-1].msg == RequestFinished("whole", "p0")
        assert _pool_is_clean(engine_loop)
    finally:
        assert engine_loop.stop(10.0)
