"""The bundled SmolLM2-135M-Instruct served by the engine equals transformers token for token: batched,
on prefix-cache hits, and with chunked prefill plus preemption."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine, RequestResult
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import FinishReason, SamplingParams
from tests.reference import hf_greedy, hf_model

pytestmark = pytest.mark.slow

PAGE = 16
NUM_NEW = 12
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=1)

USER_MESSAGES = [
    "Hi!",
    "What is 2 + 2?",
    "Name three primary colours.",
    "Translate 'good morning' into French.",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "Explain in one sentence why the sky is blue.",
    "List the planets of the solar system in order from the sun.",
    "Give me a short recipe for pancakes with the ingredients and the steps.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarise the plot of Romeo and Juliet for a ten-year-old in a few sentences.",
    "Write a Python function that returns the n-th Fibonacci number, iteratively.",
    "Compare cats and dogs as pets. " * 6,
    "Describe how a bicycle works, covering the frame, the gears, the chain and the brakes. " * 5,
    "I need advice: my tomato plants have yellow leaves at the bottom. What could cause it? " * 8,
]
RAW_TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def add(a, b):\n    return",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the boiling point " * 4,
    "Machine learning is a field of study in artificial intelligence concerned with the development "
    "and study of statistical algorithms that can learn from data and generalise to unseen data. " * 10,
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("bundled", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
             for m in USER_MESSAGES]
    encoded = [tok.encode(text, add_special_tokens=False) for text in chats + RAW_TEXTS]
    lengths = sorted(map(len, encoded))
    assert len(encoded) >= 20 and lengths[0] <= 12 and lengths[-1] >= 250, lengths
    return encoded


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    model = hf_model(loaded)
    return [hf_greedy(model, p, NUM_NEW)[:2] for p in prompts]


def _engine(loaded: LoadedModel, **overrides: object) -> Engine:
    settings = dict(model="bundled", device="cpu", dtype="float32", page_size=PAGE, num_pages=400)
    return Engine(EngineConfig(**{**settings, **overrides}), loaded=loaded)


def _assert_exact(results: list[RequestResult], reference: list[tuple[list[int], list[float]]]) -> None:
    for result, (tokens, logprobs) in zip(results, reference, strict=True):
        sample = result.samples[0]
        assert sample.token_ids == tokens, result.request_id
        assert sample.finish_reason is FinishReason.LENGTH
        assert [lp.logprob for lp in sample.logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_batched_then_cached_equal_transformers(loaded: LoadedModel, prompts: list[list[int]],
                                                reference: list) -> None:
    engine = _engine(loaded)
    first = engine.generate(prompts, GREEDY)
    _assert_exact(first, reference)
    second = engine.generate(prompts, GREEDY)
    _assert_exact(second, reference)
    # every full page before each prompt's last token was computed in the first round
    assert [r.num_cached_tokens for r in second] == [(len(p) - 1) // PAGE * PAGE for p in prompts]
    assert sum(r.num_cached_tokens for r in first) < sum(r.num_cached_tokens for r in second)


def test_chunked_with_preemption_equals_transformers(loaded: LoadedModel, prompts: list[list[int]],
                                                     reference: list) -> None:
    # 49 pages of 16 tokens: the whole batch does not fit at once, so a sequence is preempted
    engine = _engine(loaded, max_num_batched_tokens=64, num_pages=50)
    _assert_exact(engine.generate(prompts, GREEDY), reference)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_running == stats.num_waiting == 0
    engine.pool.check_invariants()
    engine.cache.check_invariants()
