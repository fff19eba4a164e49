"""The engine's greedy tokens and logprobs equal transformers' on the same weights, in every batching mode."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import FinishReason, SamplingParams
from tests.reference import hf_greedy, hf_model
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - step_mode: autouse, both modes

PRESETS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-smollm2"]
NUM_NEW = 10
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=3)


@functools.cache
def _loaded(preset: str):
    return load_model(f"random:{preset}", dtype=torch.float32, seed=1)


def _prompts(vocab: int, num: int = 22, shared: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 70))] for _ in range(num)]


@functools.cache
def _reference(preset: str, shared: int = 0) -> tuple[list[list[int]], list[tuple]]:
    loaded = _loaded(preset)
    model = hf_model(loaded)
    prompts = _prompts(loaded.config.vocab_size, shared=shared)
    return prompts, [hf_greedy(model, p, NUM_NEW, num_top=3) for p in prompts]


def _engine(preset: str, **overrides) -> Engine:
    settings = dict(model=f"random:{preset}", device="cpu", dtype="float32", num_pages=512, page_size=4)
    settings["enable_overlap"] = MODE["overlap"]
    config = EngineConfig(**{**settings, **overrides})
    return Engine(config, loaded=_loaded(preset))


def _assert_matches(results, reference) -> None:
    for result, (tokens, logprobs, tops) in zip(results, reference, strict=True):
        sample = result.samples[0]
        assert sample.token_ids == tokens
        assert sample.finish_reason is FinishReason.LENGTH
        assert [lp.logprob for lp in sample.logprobs] == pytest.approx(logprobs, abs=1e-4)
        for got, want in zip(sample.logprobs, tops):
            assert [t for t, _ in got.top] == [t for t, _ in want]


def _assert_no_leak(engine: Engine) -> None:
    engine.pool.check_invariants()
    engine.cache.check_invariants()
    assert engine.pool.num_free + engine.cache.num_cached_pages == engine.num_pages - 1


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_batched_greedy_equals_transformers(preset: str) -> None:
    prompts, reference = _reference(preset)
    engine = _engine(preset)
    _assert_matches(engine.generate(prompts, GREEDY), reference)
    _assert_no_leak(engine)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_chunked_prefill_equals_transformers(preset: str) -> None:
    prompts, reference = _reference(preset)
    engine = _engine(preset, max_num_batched_tokens=7)
    _assert_matches(engine.generate(prompts, GREEDY), reference)
    assert engine.stats().num_steps > len(prompts)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_prefix_cache_hits_equal_transformers(preset: str) -> None:
    prompts, reference = _reference(preset, shared=37)
    engine = _engine(preset)
    first = engine.generate(prompts, GREEDY)
    _assert_matches(first, reference)
    second = engine.generate(prompts, GREEDY)
    _assert_matches(second, reference)
    assert all(r.num_cached_tokens >= 36 for r in second)
    assert sum(r.num_cached_tokens for r in first) < sum(r.num_cached_tokens for r in second)
    _assert_no_leak(engine)


@pytest.mark.slow
def test_prefix_cache_off_never_hits() -> None:
    prompts, reference = _reference("tiny-llama", shared=37)
    engine = _engine("tiny-llama", enable_prefix_cache=False)
    engine.generate(prompts, GREEDY)
    second = engine.generate(prompts, GREEDY)
    _assert_matches(second, reference)
    assert all(r.num_cached_tokens == 0 for r in second)
    assert engine.pool.num_free == engine.num_pages - 1


@pytest.mark.slow
def test_requests_joining_mid_flight_equal_transformers() -> None:
    prompts, reference = _reference("tiny-llama")
    engine = _engine("tiny-llama", max_num_batched_tokens=32)
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(f"r{i}", prompt, GREEDY)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [ref[0] for ref in reference]


@pytest.mark.slow
@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_preemption_recomputes_exactly(enable_prefix_cache: bool) -> None:
    prompts, reference = _reference("tiny-llama")
    engine = _engine("tiny-llama", num_pages=48, enable_prefix_cache=enable_prefix_cache)
    results = engine.generate(prompts, GREEDY)
    _assert_matches(results, reference)
    assert engine.stats().num_preemptions > 0
    _assert_no_leak(engine)


@pytest.mark.slow
def test_n_samples_share_prompt_pages() -> None:
    loaded = _loaded("tiny-llama")
    prompt = list(range(1, 42))
    engine = _engine("tiny-llama", enable_prefix_cache=False)
    engine.add_request("n4", prompt, SamplingParams(max_tokens=3, temperature=0.0, n=4, ignore_eos=True))
    while len(engine.policy.running) < 4:  # prefill once, fork into 4 (overlap: once the token is read)
        engine.step()
    # 41 prompt tokens = 10 full pages shared + 1 partial page per sample, + nothing else
    assert engine.pool.num_used == 10 + 4
    while engine.has_unfinished():
        engine.step()
    ref = hf_greedy(hf_model(loaded), prompt, 3)[0]
    result = engine._result("n4")
    assert [s.token_ids for s in result.samples] == [ref] * 4
    engine.release_finished("n4")
    assert engine.pool.num_free == engine.num_pages - 1


def test_abort_frees_pages_at_once() -> None:
    engine = _engine("tiny-llama", enable_prefix_cache=False)
    engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("b", list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    outs = engine.abort("a")
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
    assert engine.pool.num_used == -(-(19 + 3) // 4)
    engine.abort("b")
    assert engine.pool.num_free == engine.num_pages - 1 and not engine.has_unfinished()
