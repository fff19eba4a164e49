"""Speculative decoding inside the engine (spec/engine_step.py) on a tiny random model, in both step modes: greedy
output identical to plain decoding (prompt lookup, and a replay proposer whose acceptance is set), seeds
reproducible, stops exact, rejected drafts' pages rolled back and never leaked, adaptive k and the load cut-off."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import FinishReason, SamplingParams
from services.gpu_worker.spec.proposer import ProposalRequest
from services.gpu_worker.spec.replay import ReplayProposer
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - step_mode: autouse, both modes

PAGE = 4
VOCAB = 512  # tiny-llama
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


@functools.cache
def _loaded() -> LoadedModel:
    return load_model("random:tiny-llama", dtype=torch.float32, seed=1)


def _engine(**overrides: object) -> Engine:
    settings = dict(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=256, page_size=PAGE,
                    enable_overlap=MODE["overlap"])
    return Engine(EngineConfig(**{**settings, **overrides}), loaded=_loaded())


def _spec_engine(k: int = 4, **overrides: object) -> Engine:
    return _engine(speculative_method="ngram", num_speculative_tokens=k, **overrides)


def _prompts(num: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span (prompt lookup finds drafts in them), of varied lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        span = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))]
        out.append([rng.randrange(VOCAB) for _ in range(rng.randint(0, 7))] + span * rng.randint(2, 4))
    return out


def _outputs(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY):
    results = engine.generate(prompts, params)
    return [(r.samples[0].token_ids, r.samples[0].finish_reason,
             None if r.samples[0].logprobs is None else [lp.logprob for lp in r.samples[0].logprobs])
            for r in results]


def _assert_same(got, want) -> None:
    for (tokens, reason, logprobs), (want_tokens, want_reason, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert reason is want_reason
        if logprobs is not None and want_logprobs is not None:
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def _assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished()
    engine.pool.check_invariants()
    engine.cache.check_invariants()
    engine.policy.check_invariants()
    assert engine.pool.num_free + engine.cache.num_cached_pages == engine.num_pages - 1


def _replay(continuations: dict[tuple[int, ...], list[int]], alpha: float, seed: int = 0) -> ReplayProposer:
    """Each sequence's known greedy continuation, each draft the true token with probability alpha (spec/replay.py)."""
    return ReplayProposer(continuations, alpha, VOCAB, seed)


@functools.cache
def _plain(key: str) -> list:
    prompts = _prompts()
    params = {"greedy": GREEDY, "long": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)}[key]
    return _outputs(_engine(enable_overlap=False), prompts, params)


def test_ngram_greedy_equals_plain_decoding() -> None:
    engine = _spec_engine()
    got = _outputs(engine, _prompts())
    assert all(logprobs is not None for _, _, logprobs in got)  # the target's, compared below
    _assert_same(got, _plain("greedy"))
    assert engine.metrics.num_spec_draft_tokens > 0
    assert 0 < engine.metrics.num_spec_accepted_tokens <= engine.metrics.num_spec_draft_tokens
    _assert_idle(engine)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9, 1.0])
def test_replayed_drafts_give_plain_greedy_output_at_any_acceptance(alpha: float) -> None:
    prompts = _prompts()
    want = _plain("long")
    engine = _spec_engine(k=5)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, alpha)
    _assert_same(_outputs(engine, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)), want)
    accepted = engine.metrics.num_spec_accepted_tokens
    assert (accepted == 0) if alpha == 0.0 else accepted > 0
    if alpha == 1.0:  # every draft accepted: each verifying step emits k + 1 tokens (adaptive k stays at 5)
        assert accepted == engine.metrics.num_spec_draft_tokens
        assert engine.stats().num_steps < 40 // 3
    _assert_idle(engine)


def test_chunked_prefill_and_prefix_cache_hits_with_speculation() -> None:
    prompts = _prompts()
    engine = _spec_engine(max_num_batched_tokens=7)
    _assert_same(_outputs(engine, prompts), _plain("greedy"))
    again = engine.generate(prompts, GREEDY)  # the prompts' pages are cached now
    assert sum(r.num_cached_tokens for r in again) > 0
    _assert_same([(r.samples[0].token_ids, r.samples[0].finish_reason, None) for r in again], _plain("greedy"))
    assert engine.stats().num_steps > 2 * len(prompts)
    _assert_idle(engine)


def test_drafts_share_a_step_with_prefill_chunks_and_plain_decodes() -> None:
    prompts = _prompts()
    engine = _spec_engine(max_num_batched_tokens=16)
    # drafts every step (prompt lookup finds none for some of these sequences, which then wait: adaptive.py)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, _plain("greedy"))}, 0.7)
    steps = []
    original = engine._forward

    def recording(plan):
        steps.append([(item.num_new_tokens, item.num_draft_tokens, item.is_sampling) for item in plan.items])
        return original(plan)

    engine._forward = recording
    mixed = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=i % 2 == 0)
             for i in range(len(prompts))]
    _assert_same(_outputs(engine, prompts, mixed), [(t, r, None) for t, r, _ in _plain("greedy")])
    assert any(any(d for _, d, _ in s) and any(n > 1 and not d for n, d, _ in s) for s in steps)  # drafts + prefill
    assert any(any(d for _, d, _ in s) and any(n == 1 for n, _, _ in s) for s in steps)  # drafts + plain decodes
    assert all(sum(n for n, _, _ in s) <= 16 for s in steps)
    _assert_idle(engine)


def test_a_request_may_turn_speculation_off() -> None:
    engine = _spec_engine()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    _assert_same(_outputs(engine, _prompts(), params), [(t, r, None) for t, r, _ in _plain("greedy")])
    assert engine.metrics.num_spec_drafts == 0


def test_no_speculation_above_the_batch_size_limit() -> None:
    engine = _spec_engine(speculative_max_batch_size=3)
    _outputs(engine, _prompts(num=6))
    assert engine.metrics.num_spec_drafts == 0
    engine = _spec_engine(speculative_max_batch_size=3)
    _outputs(engine, _prompts(num=3))
    assert engine.metrics.num_spec_drafts > 0


def test_seeded_sampling_with_speculation_is_reproducible() -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    first = _outputs(_spec_engine(), _prompts(), params)
    second = _outputs(_spec_engine(), _prompts(), params)
    assert first == second
    alone = _outputs(_spec_engine(), _prompts()[:1], params)  # a seeded row does not depend on its batch
    assert alone[0] == first[0]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_is_exact_when_drafts_would_run_past_it(max_tokens: int) -> None:
    prompts = _prompts()
    want = _plain("long")
    engine = _spec_engine(k=5)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, 1.0)
    got = _outputs(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for (tokens, reason, _), (full, _, _) in zip(got, want):
        assert tokens == full[:max_tokens]
        assert reason is FinishReason.LENGTH
    _assert_idle(engine)


def test_a_stop_token_inside_accepted_drafts_truncates_the_rest() -> None:
    prompts = _prompts()
    want = _plain("long")
    engine = _spec_engine(k=5)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, 1.0)
    stops = [w[0][9] for w in want]  # the 10th token of each output (an earlier equal token stops it first)
    params = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,)) for stop in stops]
    got = _outputs(engine, prompts, params)
    for (tokens, reason, _), (full, _, _), stop in zip(got, want, stops):
        assert tokens == full[:full.index(stop) + 1]
        assert reason is FinishReason.STOP
    assert engine.metrics.num_spec_accepted_tokens > 0
    _assert_idle(engine)


def test_the_pool_gets_every_page_back_after_many_speculative_requests() -> None:
    engine = _spec_engine(k=6, enable_prefix_cache=False, num_pages=64)
    start = engine.pool.num_free
    prompts = _prompts(num=12, seed=3)
    want = _outputs(_engine(enable_overlap=False, enable_prefix_cache=False), prompts)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, 0.6, seed=5)
    for _ in range(3):
        _assert_same(_outputs(engine, prompts), want)
        assert engine.pool.num_free == start
    assert engine.metrics.num_spec_accepted_tokens > 0
    assert engine.metrics.num_spec_accepted_tokens < engine.metrics.num_spec_draft_tokens
    engine.policy.check_invariants()


def test_rejected_drafts_never_reach_the_prefix_cache() -> None:
    prompts = _prompts()
    want = _plain("long")
    engine = _spec_engine(k=5)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, 0.5, seed=2)
    _outputs(engine, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for prompt, (full, _, _) in zip(prompts, want):  # everything cached is a prefix of prompt + its true output
        sequence = prompt + full
        match = engine.cache.match_prefix(sequence, 0.0)
        assert match.num_tokens >= (len(sequence) - 1) // PAGE * PAGE - PAGE
    _assert_idle(engine)


def test_speculation_that_accepts_nothing_backs_off() -> None:
    prompts = _prompts(num=1)
    want = _outputs(_engine(enable_overlap=False), prompts, SamplingParams(max_tokens=60, temperature=0.0,
                                                                          ignore_eos=True))
    engine = _spec_engine(k=4)
    proposer = _replay({tuple(prompts[0]): want[0][0]}, 0.0)
    engine.speculator.proposer = proposer
    _assert_same(_outputs(engine, prompts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)), want)
    # 4 + 2 + 1 drafts, then a probe of 1 every 16 steps: far fewer than 4 a step
    assert proposer.num_proposed <= 4 + 2 + 1 + 60 // 16 + 1
    assert engine.metrics.num_spec_accepted_tokens == 0


def test_rejected_drafts_give_their_pages_back_at_once() -> None:
    prompts = _prompts()
    want = _plain("long")
    engine = _spec_engine(k=6, enable_prefix_cache=False)
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, 0.3, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    num_checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.policy.running:  # pages cover the computed tokens and, at most, the next one's slot
            if seq.num_uncomputed == 1:
                assert len(seq.page_ids) == -(-seq.num_computed // PAGE)
                num_checked += 1
    engine.flush()
    assert num_checked > 0 and engine.metrics.num_spec_accepted_tokens < engine.metrics.num_spec_draft_tokens
    assert engine.pool.num_free == engine.num_pages - 1


def test_penalties_and_logit_bias_see_the_drafts_before_each_position() -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, logit_bias=((7, 3.0),))
    prompts = _prompts()
    want = _outputs(_engine(enable_overlap=False), prompts, params)
    engine = _spec_engine()
    engine.speculator.proposer = _replay({tuple(p): w[0] for p, w in zip(prompts, want)}, 0.7, seed=1)
    _assert_same(_outputs(engine, prompts, params), want)
    assert engine.metrics.num_spec_accepted_tokens > 0


def test_n_samples_speculate_each_and_reproduce() -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=3, n=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = _spec_engine()
        results = engine.generate(_prompts(num=2), params)
        runs.append([[s.token_ids for s in r.samples] for r in results])
        _assert_idle(engine)
    assert runs[0] == runs[1]
    assert all(len({tuple(t) for t in samples}) > 1 for samples in runs[0])


def test_only_steps_with_drafts_give_up_the_overlap() -> None:
    if not MODE["overlap"]:
        pytest.skip("overlap mode only")
    engine = _spec_engine()
    prompt = _prompts(num=1)[0]
    engine.add_request("off", prompt, SamplingParams(max_tokens=8, temperature=0.0, speculative=False))
    engine.step()
    engine.step()
    assert engine._launched is not None  # a plain step stays on the device while the next is planned
    engine.abort("off")
    engine.flush()
    engine.add_request("on", prompt, SamplingParams(max_tokens=24, temperature=0.0))
    drafted = []
    while engine.has_unfinished():
        engine.step()
        drafted.append(engine.metrics.num_spec_drafts)
        if len(drafted) > 1 and drafted[-1] > drafted[-2]:
            assert engine._launched is None  # a step that verified drafts was read at once
    assert drafted[-1] > 0


class _FindsNothing:
    """A proposer that never finds drafts (prompt lookup over text that never repeats)."""

    def __init__(self) -> None:
        self.num_requests = 0

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        self.num_requests += len(requests)
        return [[] for _ in requests]

    def forget(self, request_id: str, index: int = 0) -> None:
        pass


def test_a_sequence_whose_proposals_find_nothing_waits_and_keeps_the_overlap() -> None:
    prompt = _prompts(num=1)[0]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = _outputs(_engine(enable_overlap=False), [prompt], params)
    engine = _spec_engine(k=4)
    proposer = engine.speculator.proposer = _FindsNothing()
    engine.add_request("r", prompt, params)
    tokens, wants = [], []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
        # overlap mode: the next step reads this one's tokens before launching only where this is True
        wants.append(engine.speculator.wants_host_tokens(engine.policy.running))
    tokens += [t for out in engine.flush() for t in out.token_ids]
    assert tokens == want[0][0]
    # after the prefill: 4 empty proposals, then waits of 16 and 32 steps, each ended by one empty probe
    assert proposer.num_requests == 4 + 2
    assert wants[:4] == [True] * 4 and wants[4:19] == [False] * 15 and sum(wants) == 4 + 2
    _assert_idle(engine)
