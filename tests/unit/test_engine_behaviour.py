"""Engine behaviour on a tiny random model: seeded sampling, stop rules, bad input, KV events,
on-demand pages, chunked prefill beside decodes, and sampling options plumbed through."""
from __future__ import annotations

import dataclasses
import functools
import random

import msgspec
import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import FinishReason, SamplingParams, TokenOutput
from shared.hashing import hash_blocks
from shared.messages import BlocksRemoved, BlocksStored, KVEvent
from shared.sampling import SamplingError
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - step_mode: autouse, both modes

PAGE = 4
VOCAB = 512  # tiny-llama
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


@functools.cache
def _loaded() -> LoadedModel:
    return load_model("random:tiny-llama", dtype=torch.float32, seed=1)


def _with_eos(eos: tuple[int, ...]) -> LoadedModel:
    loaded = _loaded()
    return dataclasses.replace(loaded, config=loaded.config.with_(eos_token_ids=eos))


def _engine(loaded: LoadedModel | None = None, **overrides: object) -> Engine:
    settings = dict(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=256, page_size=PAGE)
    settings["enable_overlap"] = MODE["overlap"]
    return Engine(EngineConfig(**{**settings, **overrides}), loaded=loaded or _with_eos(()))


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0].samples[0].token_ids


def _assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished()
    engine.pool.check_invariants()
    engine.cache.check_invariants()
    assert engine.pool.num_free + engine.cache.num_cached_pages == engine.num_pages - 1


# --- seeded sampling ----------------------------------------------------------------------------


def test_seeded_sample_is_the_same_alone_and_batched() -> None:
    prompt = _prompt(23, seed=1)
    alone = _tokens(_engine(), prompt, SEEDED)
    others = [_prompt(n, seed=10 + n) for n in (5, 40, 17)]
    other_params = [SamplingParams(max_tokens=20, temperature=1.0),
                    msgspec.structs.replace(SEEDED, seed=8, max_tokens=5),
                    SamplingParams(max_tokens=9, temperature=0.5, top_k=20)]
    engine = _engine(max_num_batched_tokens=16)
    results = engine.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [SEEDED] + other_params[2:])
    assert results[2].samples[0].token_ids == alone
    assert len(alone) == 12


def test_different_seeds_differ() -> None:
    prompt = _prompt(23, seed=1)
    engine = _engine()
    seven = _tokens(engine, prompt, SEEDED)
    eight = _tokens(engine, prompt, msgspec.structs.replace(SEEDED, seed=8))
    assert seven != eight
    assert _tokens(engine, prompt, SEEDED) == seven


def test_n_seeded_samples_are_distinct_and_reproducible() -> None:
    prompt = _prompt(23, seed=1)
    params = msgspec.structs.replace(SEEDED, n=3)
    first = [s.token_ids for s in _engine().generate([prompt], params)[0].samples]
    again = [s.token_ids for s in _engine().generate([prompt], params)[0].samples]
    assert len({tuple(t) for t in first}) == 3
    assert again == first


# --- stop rules ---------------------------------------------------------------------------------


def _first_new_token_index(tokens: list[int], start: int = 2) -> int:
    """An index k >= start whose token does not occur earlier in tokens."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_token_id_ends_with_stop() -> None:
    prompt = _prompt(15, seed=2)
    engine = _engine()
    full = _tokens(engine, prompt, _greedy(12))
    k = _first_new_token_index(full)
    sample = engine.generate([prompt], _greedy(12, stop_token_ids=(full[k],)))[0].samples[0]
    assert sample.token_ids == full[: k + 1]
    assert sample.finish_reason is FinishReason.STOP
    _assert_idle(engine)


def test_eos_stops_unless_ignored() -> None:
    prompt = _prompt(15, seed=2)
    full = _tokens(_engine(), prompt, _greedy(12))
    k = _first_new_token_index(full)
    engine = _engine(_with_eos((full[k],)))
    stopped = engine.generate([prompt], _greedy(12))[0].samples[0]
    ignored = engine.generate([prompt], _greedy(12, ignore_eos=True))[0].samples[0]
    assert (stopped.token_ids, stopped.finish_reason) == (full[: k + 1], FinishReason.STOP)
    assert (ignored.token_ids, ignored.finish_reason) == (full, FinishReason.LENGTH)


def test_max_tokens_gives_length() -> None:
    sample = _engine().generate([_prompt(9)], _greedy(7))[0].samples[0]
    assert len(sample.token_ids) == 7
    assert sample.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(("prompt_len", "num_out"), [(15, 5), (19, 1)])
def test_a_request_that_fills_the_context_runs_to_its_end(prompt_len: int, num_out: int) -> None:
    engine = _engine(max_model_len=20)  # longer requests are refused (context_length_exceeded, tested above)
    sample = engine.generate([_prompt(prompt_len)], _greedy(num_out))[0].samples[0]
    assert len(sample.token_ids) == num_out
    assert sample.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(("prompt_len", "num_out"), [(15, 5), (19, 1)])
def test_a_default_max_tokens_is_clipped_to_the_context_left(prompt_len: int, num_out: int) -> None:
    engine = _engine(max_model_len=20)  # a chat body without max_tokens: the gateway's ceiling of 100 does not fit
    sample = engine.generate([_prompt(prompt_len)], _greedy(100, is_max_tokens_default=True))[0].samples[0]
    assert len(sample.token_ids) == num_out
    assert sample.finish_reason is FinishReason.LENGTH


def test_growth_past_the_whole_pool_ends_with_length() -> None:
    # 9 pages of 4 = 36 usable slots: a sequence alone can hold 36 tokens of KV, never more.
    engine = _engine(num_pages=10)
    engine.add_request("big", _prompt(30), _greedy(100))
    for _ in range(50):
        if not engine.has_unfinished():
            break
        engine.step()
    sample = engine._result("big").samples[0]
    assert (len(sample.token_ids), sample.finish_reason) == (6, FinishReason.LENGTH)
    engine.release_finished("big")
    _assert_idle(engine)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "message"), [
    ([], "the prompt is empty"),
    ([1, VOCAB], r"prompt token ids must be in \[0, 512\)"),
    ([-1, 5], r"prompt token ids must be in \[0, 512\)"),
    (_prompt(29), r"maximum context length is 32 tokens. However, you requested 33 tokens \(29 in the messages, "
                  r"4 in the completion\)"),
    (_prompt(40), "maximum context length is 32 tokens. However, you requested 44 tokens"),
])
def test_bad_prompt_is_rejected_and_engine_keeps_serving(prompt: list[int], message: str) -> None:
    engine = _engine(max_model_len=32)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, _greedy(4))
    _assert_still_serves(engine)


def test_context_length_error_carries_its_openai_code() -> None:
    engine = _engine(max_model_len=32)
    with pytest.raises(SamplingError) as caught:
        engine.add_request("bad", _prompt(8), _greedy(10**9))
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")
    fits = engine.generate([_prompt(28)], _greedy(4))[0].samples[0]  # 28 + 4 == 32: exactly the context
    assert len(fits.token_ids) == 4
    _assert_still_serves(engine)


def test_prompt_larger_than_kv_pool_is_rejected() -> None:
    engine = _engine(num_pages=5)  # 4 usable pages = 16 tokens
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        engine.add_request("bad", _prompt(16), _greedy(4))
    _assert_still_serves(engine)


def test_duplicate_request_id_is_rejected() -> None:
    engine = _engine()
    engine.add_request("a", _prompt(10), _greedy(4))
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        engine.add_request("a", _prompt(11), _greedy(4))
    while engine.has_unfinished():
        engine.step()
    assert engine._result("a").samples[0].token_ids == _tokens(_engine(), _prompt(10), _greedy(4))
    engine.release_finished("a")
    _assert_still_serves(engine)


def _assert_still_serves(engine: Engine) -> None:
    assert not engine.has_unfinished()
    prompt = _prompt(12, seed=3)
    sample = engine.generate([prompt], _greedy(4))[0].samples[0]
    assert sample.token_ids == _tokens(_engine(), prompt, _greedy(4))
    assert sample.finish_reason is FinishReason.LENGTH
    _assert_idle(engine)


# --- KV events ----------------------------------------------------------------------------------


def _stored_hashes(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes]


def _removed_hashes(events: list[KVEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlocksRemoved) for h in e.block_hashes]


def _computed_hashes(engine: Engine, prompt: list[int], output: list[int]) -> list[int]:
    """The full pages of the tokens whose KV was computed (the last sampled token never is)."""
    computed = prompt + output[:-1]
    return hash_blocks(computed, PAGE, engine.model_config.model_id)


def test_finished_request_stores_its_full_pages() -> None:
    engine = _engine()
    prompt = _prompt(10)
    output = _tokens(engine, prompt, _greedy(5))
    events = engine.cache.drain_events()
    assert _stored_hashes(events) == _computed_hashes(engine, prompt, output)
    assert len(_stored_hashes(events)) == 3  # 14 computed tokens → 3 full pages
    assert _removed_hashes(events) == []
    assert engine.cache.drain_events() == []


def test_eviction_emits_blocks_removed() -> None:
    engine = _engine(num_pages=9)  # 8 usable pages
    first_prompt = _prompt(10)
    first = _computed_hashes(engine, first_prompt, _tokens(engine, first_prompt, _greedy(5)))
    engine.cache.drain_events()
    second_prompt = _prompt(20, seed=5)
    second = _computed_hashes(engine, second_prompt, _tokens(engine, second_prompt, _greedy(10)))
    events = engine.cache.drain_events()
    assert sorted(_removed_hashes(events)) == sorted(first)
    assert _stored_hashes(events) == second
    _assert_idle(engine)


def test_cache_off_emits_no_events() -> None:
    engine = _engine(enable_prefix_cache=False)
    engine.generate([_prompt(10), _prompt(30, seed=4)], _greedy(8))
    assert engine.cache.drain_events() == []
    assert engine.pool.num_free == engine.num_pages - 1


# --- pages on demand, chunked prefill -----------------------------------------------------------


def test_pages_are_taken_on_demand() -> None:
    engine = _engine(enable_prefix_cache=False)
    engine.add_request("long", _prompt(10), _greedy(1000, ignore_eos=True))
    held = []
    for _ in range(6):
        engine.step()
        held.append(engine.pool.num_used)
    # step s computes 10 + s - 1 tokens of KV: ceil(10/4), ceil(11/4), ... ceil(15/4)
    assert held == [3, 3, 3, 4, 4, 4]
    engine.abort("long")
    assert engine.pool.num_free == engine.num_pages - 1


def _step_counts(outputs: list[TokenOutput]) -> dict[str, int]:
    return {o.request_id: len(o.token_ids) for o in outputs}


def test_chunked_prefill_does_not_stall_decodes() -> None:
    engine = _engine(max_num_batched_tokens=8, enable_overlap=False)  # serial: a step's tokens come back from it
    engine.add_request("decode", _prompt(6), _greedy(100))
    assert _step_counts(engine.step()) == {"decode": 1}
    engine.add_request("prefill", _prompt(100, seed=6), _greedy(3))
    per_step = [_step_counts(engine.step()) for _ in range(15)]
    # 100 prompt tokens in chunks of 8 - 1 (the decode's token) = 15 steps; the last one samples
    assert per_step[:14] == [{"decode": 1}] * 14
    assert per_step[14] == {"decode": 1, "prefill": 1}


# --- sampling options ---------------------------------------------------------------------------


def test_logprobs_give_alternatives() -> None:
    sample = _engine().generate([_prompt(12)], _greedy(6, logprobs=2))[0].samples[0]
    assert [len(lp.top) for lp in sample.logprobs] == [2] * 6
    assert [lp.token_id for lp in sample.logprobs] == sample.token_ids
    assert [lp.top[0] for lp in sample.logprobs] == [(lp.token_id, lp.logprob) for lp in sample.logprobs]
    assert all(lp.top[0][1] >= lp.top[1][1] for lp in sample.logprobs)


def _num_repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_repetition_penalty_reduces_repeats() -> None:
    engine = _engine()
    prompt = _prompt(8, seed=9)
    plain = _tokens(engine, prompt, _greedy(30))
    penalized = _tokens(engine, prompt, _greedy(30, repetition_penalty=2.0))
    assert _num_repeats(plain) > 0
    assert _num_repeats(penalized) < _num_repeats(plain)


def test_requests_arriving_together_share_the_prefix_one_computes() -> None:
    """In-batch prefix sharing: followers wait for the leader's pages instead of computing them again."""
    shared = _prompt(40, seed=3)  # 10 full pages
    prompts = [shared + _prompt(5, seed=10 + i) for i in range(4)]
    alone = [_tokens(_engine(), p, _greedy(4, ignore_eos=True)) for p in prompts]
    engine = _engine()
    results = engine.generate(prompts, _greedy(4, ignore_eos=True))
    assert [r.samples[0].token_ids for r in results] == alone
    assert [r.num_cached_tokens for r in results] == [0, 40, 40, 40]
    cold = _engine(enable_prefix_cache=False).generate(prompts, _greedy(4, ignore_eos=True))
    assert [r.num_cached_tokens for r in cold] == [0, 0, 0, 0]
    _assert_idle(engine)


def test_followers_wait_for_a_leader_prefilling_in_chunks() -> None:
    shared = _prompt(40, seed=4)
    prompts = [shared + _prompt(3, seed=20 + i) for i in range(3)]
    engine = _engine(max_num_batched_tokens=8)
    results = engine.generate(prompts, _greedy(3, ignore_eos=True))
    assert [r.num_cached_tokens for r in results] == [0, 40, 40]
    assert [r.samples[0].token_ids for r in results] == [_tokens(_engine(), p, _greedy(3, ignore_eos=True))
                                                         for p in prompts]


# --- overlap mode -------------------------------------------------------------------------------


def test_overlap_queues_the_next_step_before_reading_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap mode: step N+1 is launched before step N's tokens are read (the host's work runs while the
    device computes); a sequence ending by length is not scheduled again, one ending by a stop id costs one
    discarded row; the tokens are those of serial mode."""
    from services.gpu_worker import sampler

    prompt_a, prompt_b = _prompt(9, seed=4), _prompt(7, seed=5)
    serial = _engine(enable_overlap=False)
    full_a, full_b = _tokens(serial, prompt_a, _greedy(3)), _tokens(serial, prompt_b, _greedy(8))
    stop_at = _first_new_token_index(full_b)

    engine = _engine(enable_overlap=True)
    events: list[str] = []
    forward, resolve = engine._forward, sampler.SampledBatch.resolve
    monkeypatch.setattr(engine, "_forward", lambda plan: events.append(f"forward{len(plan.items)}") or forward(plan))
    monkeypatch.setattr(sampler.SampledBatch, "resolve", lambda self: events.append("read") or resolve(self))
    engine.add_request("len", prompt_a, _greedy(3))
    engine.add_request("stop", prompt_b, _greedy(8, stop_token_ids=(full_b[stop_at],)))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert events[:4] == ["forward2", "forward2", "read", "forward2"]  # step 2 queued before step 1 was read
    tokens = {rid: [t for o in outputs if o.request_id == rid for t in o.token_ids] for rid in ("len", "stop")}
    assert tokens == {"len": full_a, "stop": full_b[: stop_at + 1]}
    # "len" is not run after its 3rd token was sampled; "stop" runs one step past its stop token
    num_forwards = [int(e[len("forward"):]) for e in events if e.startswith("forward")]
    assert num_forwards == [2, 2, 2] + [1] * (stop_at + 1 - 2)
    engine.flush()
    _assert_idle(engine)
