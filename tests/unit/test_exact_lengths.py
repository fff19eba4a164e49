"""ignore_eos requests return exactly max_tokens on both KV-cache dtypes (issue 24), even when every token the
model picks is an eos id, with preemption in a small pool, in both step modes."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import FinishReason, SamplingParams
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - step_mode: autouse, both modes

EOS_IDS = (2, 3)  # tiny-llama's


@functools.cache
def _loaded() -> LoadedModel:
    return load_model("random:tiny-llama", dtype=torch.float32, seed=3)


def _eos_engine(kv_cache_dtype: str) -> Engine:
    """An engine whose LM head always picks an eos id (2 or 3, by the hidden state's sign)."""
    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", page_size=4, num_pages=40,
                          kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, max_num_batched_tokens=32,
                          enable_overlap=MODE["overlap"])
    engine = Engine(config, loaded=_loaded())
    logits = engine.model.logits

    def eos_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden).clone()  # [B, V] fp32
        pick = torch.where(hidden[:, 0] > 0, EOS_IDS[0], EOS_IDS[1])  # [B]
        out[torch.arange(out.shape[0]), pick] = 1e4
        return out

    engine.model.logits = eos_logits
    return engine


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_ignore_eos_requests_return_exactly_max_tokens(kv_cache_dtype: str) -> None:
    engine = _eos_engine(kv_cache_dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(3, 30))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True) for _ in prompts]

    results = engine.generate(prompts, params)

    assert engine.stats().num_preemptions > 0  # the small pool makes sequences recompute
    for result, p in zip(results, params):
        sample = result.samples[0]
        assert len(sample.token_ids) == p.max_tokens
        assert set(sample.token_ids) <= set(EOS_IDS)
        assert sample.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_without_ignore_eos_the_same_engine_stops_at_the_first_token(kv_cache_dtype: str) -> None:
    engine = _eos_engine(kv_cache_dtype)
    results = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=9, temperature=0.0))
    assert len(results[0].samples[0].token_ids) == 1
    assert results[0].samples[0].finish_reason is FinishReason.STOP
