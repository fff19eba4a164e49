"""Prompt logprobs from the engine equal transformers' teacher-forced ones (fp32, CPU, the bundled model): with the
prefix cache warm, across prefill chunks and preemption, with max_tokens 0 and n > 1, in both step modes."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.prompt_logprobs import prompt_logprob_tensors
from services.gpu_worker.request import FinishReason, SamplingParams, TokenLogprob
from tests.reference import hf_model, hf_prompt_logprobs
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - autouse: every test runs serial and overlapped

pytestmark = pytest.mark.slow

PAGE = 16
NUM_TOP = 3
TEXTS = [
    "The capital of France is Paris.",
    "Once upon a time, in a land far away, there lived a",
    "Machine learning is a field of study in artificial intelligence concerned with the development and study of "
    "statistical algorithms that can learn from data and generalise to unseen data. " * 3,
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("bundled", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    encoded = [loaded.tokenizer.encode(text) for text in TEXTS]
    assert [len(p) > 64 for p in encoded] == [False, False, True]
    return encoded


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, prompts: list[list[int]]) -> list[list]:
    model = hf_model(loaded)
    return [hf_prompt_logprobs(model, p, NUM_TOP) for p in prompts]


def _engine(loaded: LoadedModel, **overrides: object) -> Engine:
    settings = dict(model="bundled", device="cpu", dtype="float32", page_size=PAGE, num_pages=200,
                    enable_overlap=MODE["overlap"])
    return Engine(EngineConfig(**{**settings, **overrides}), loaded=loaded)


def _assert_equal(got: list[TokenLogprob | None] | None, want: list, prompt: list[int]) -> None:
    """Every prompt token's logprob within 1e-4 of transformers', its rank, and the top alternatives."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position, (entry, expected) in enumerate(zip(got[1:], want[1:]), start=1):
        logprob, rank, top = expected
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(logprob, abs=1e-4), position
        assert entry.rank == rank, position
        assert [t for t, _ in entry.top] == [t for t, _ in top], position
        assert [v for _, v in entry.top] == pytest.approx([v for _, v in top], abs=1e-4)


def test_prompt_logprobs_equal_transformers_and_survive_a_warm_cache(loaded: LoadedModel, prompts: list[list[int]],
                                                                     reference: list[list]) -> None:
    engine = _engine(loaded)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)
    for _ in range(2):  # the second round finds every full page cached, and still computes every position
        results = engine.generate(prompts, params)
        for result, prompt, want in zip(results, prompts, reference, strict=True):
            _assert_equal(result.prompt_logprobs, want, prompt)
            assert result.num_cached_tokens == 0
            assert len(result.samples[0].token_ids) == 2
    plain = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    # the pages a prompt-logprobs request computed entered the cache: a request without them reuses them
    assert [r.num_cached_tokens for r in plain] == [(len(p) - 1) // PAGE * PAGE for p in prompts]
    engine.pool.check_invariants()
    engine.cache.check_invariants()


def test_a_cached_prefix_is_recomputed_only_from_the_first_position_still_needed(loaded: LoadedModel,
                                                                                prompts: list[list[int]],
                                                                                reference: list[list]) -> None:
    engine = _engine(loaded)
    long = prompts[2]
    engine.generate([long], SamplingParams(max_tokens=1, temperature=0.0))
    [result] = engine.generate([long], SamplingParams(max_tokens=0, prompt_logprobs=NUM_TOP))
    _assert_equal(result.prompt_logprobs, reference[2], long)
    assert result.num_cached_tokens == 0 and result.samples[0].token_ids == []
    assert result.samples[0].finish_reason is FinishReason.LENGTH


def test_chunked_prefill_with_preemption_equals_transformers(loaded: LoadedModel, prompts: list[list[int]],
                                                             reference: list[list]) -> None:
    # 32-token steps split the long prompt over several chunks; 7 pages do not hold every prompt at once
    engine = _engine(loaded, max_num_batched_tokens=32, num_pages=8)
    results = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                      prompt_logprobs=NUM_TOP))
    for result, prompt, want in zip(results, prompts, reference, strict=True):
        _assert_equal(result.prompt_logprobs, want, prompt)
    assert engine.stats().num_preemptions > 0
    engine.pool.check_invariants()


def test_max_tokens_0_and_n_2_send_the_prompt_logprobs_on_every_sample(loaded: LoadedModel,
                                                                       prompts: list[list[int]],
                                                                       reference: list[list]) -> None:
    engine = _engine(loaded)
    for max_tokens in (0, 3):
        engine.add_request(f"r{max_tokens}", prompts[0], SamplingParams(max_tokens=max_tokens, n=2, seed=1,
                                                                        prompt_logprobs=1))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    outputs += engine.flush()
    for request_id, num_tokens in (("r0", 0), ("r3", 3)):
        mine = [out for out in outputs if out.request_id == request_id]
        for index in (0, 1):
            sample = [out for out in mine if out.index == index]
            assert sum(len(out.token_ids) for out in sample) == num_tokens
            assert sample[-1].finish_reason is FinishReason.LENGTH
            carrying = [out for out in sample if out.prompt_logprobs is not None]
            assert len(carrying) == 1 and carrying[0] is sample[0]
            got = carrying[0].prompt_logprobs
            assert [e.logprob for e in got[1:]] == pytest.approx([w[0] for w in reference[0][1:]], abs=1e-4)
            assert all(len(e.top) == 1 for e in got[1:])


def test_logits_in_slices_equal_logits_at_once() -> None:
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    hidden, targets = torch.randn(7, 8), torch.randint(0, 50, (7,))
    whole = prompt_logprob_tensors(lambda h: h @ weight.T, hidden, targets, 4, num_slice_rows=7)
    sliced = prompt_logprob_tensors(lambda h: h @ weight.T, hidden, targets, 4, num_slice_rows=2)
    logp = (hidden @ weight.T).log_softmax(-1)
    assert torch.allclose(whole[0], logp[torch.arange(7), targets])
    assert whole[1].tolist() == [int((row > row[t]).sum()) + 1 for row, t in zip(logp, targets)]
    assert [torch.allclose(a.float(), b.float()) for a, b in zip(whole, sliced, strict=True)] == [True] * 4
    assert torch.equal(whole[3], sliced[3]) and torch.equal(whole[1], sliced[1])
