"""Quantized checkpoints load as published (quant/checkpoint.py, loader, model_runner): an AWQ or GPTQ checkpoint runs
the very numbers of the dense model it dequantizes to; an FP8 (compressed-tensors) checkpoint runs what quantizing
its dense model on load runs; `quantization` on a dense checkpoint quantizes it; what cannot load is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.request import SamplingParams
from tests.unit.hf_checkpoints import random_prompts
from tests.unit.quant_checkpoints import tiny_dense_llama, write_quantized

GROUP = 32
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return tiny_dense_llama(str(tmp_path_factory.mktemp("quant")))


def _generate(model: str, **overrides) -> tuple[Engine, list]:
    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_pages=128, page_size=4, **overrides))
    return engine, engine.generate(random_prompts(256, num=4), PARAMS)


def _tokens_and_logprobs(results: list) -> list[tuple[list[int], list[float]]]:
    return [(r.samples[0].token_ids, [lp.logprob for lp in r.samples[0].logprobs]) for r in results]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_runs_the_model_it_dequantizes_to(dense_dir: Path, method: str):
    quantized, dequantized = write_quantized(dense_dir, dense_dir.parent / method, method, GROUP)
    engine, got = _generate(str(quantized))
    _, want = _generate(str(dequantized))
    assert engine.runner.num_quantized_layers == 2 * 7
    assert engine.allocator_idle_bytes == 0  # the ready log's allocator_idle_gib: CUDA's caching allocator only
    layer = engine.runner.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantizedLinear) and layer.method == "int4" and layer.group_size == GROUP
    assert not isinstance(getattr(engine.runner.model, "lm_head"), QuantizedLinear)
    assert _tokens_and_logprobs(got) == _tokens_and_logprobs(want)


def test_fp8_checkpoint_equals_fp8_on_load(dense_dir: Path):
    quantized, _ = write_quantized(dense_dir, dense_dir.parent / "fp8", "fp8", GROUP)
    engine, got = _generate(str(quantized))
    _, on_load = _generate(str(dense_dir), quantization="fp8")
    _, dense = _generate(str(dense_dir))
    assert engine.runner.num_quantized_layers == 2 * 7
    assert engine.runner.model.model.layers[1].mlp.down_proj.qweight.dtype == torch.float8_e4m3fn
    assert _tokens_and_logprobs(got) == _tokens_and_logprobs(on_load)
    # W8A8 is not the dense model: the logprobs move, a little
    gaps = [abs(a - b) for (_, la), (_, lb) in zip(_tokens_and_logprobs(got), _tokens_and_logprobs(dense))
            for a, b in zip(la, lb)]
    assert 0 < max(gaps) < 0.5


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_quantization_on_load_replaces_every_decoder_linear(dense_dir: Path, method: str):
    engine, results = _generate(str(dense_dir), quantization=method)
    assert engine.runner.num_quantized_layers == 2 * 7
    assert all(len(r.samples[0].token_ids) == PARAMS.max_tokens for r in results)


def test_a_quantized_checkpoint_refuses_another_method(dense_dir: Path):
    quantized, _ = write_quantized(dense_dir, dense_dir.parent / "awq-refuse", "awq", GROUP)
    with pytest.raises(ValueError, match="quantized with awq, not fp8"):
        _generate(str(quantized), quantization="fp8")


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32}, "8 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "GEMM version"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "not FP8"),
])
def test_unsupported_quantized_checkpoints_are_refused_clearly(dense_dir: Path, tmp_path: Path, qcfg, message):
    quantized, _ = write_quantized(dense_dir, tmp_path / "q", "awq", GROUP)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    with pytest.raises(ValueError, match=message):
        load_model(str(quantized))


def test_config_saying_quantized_without_quantized_tensors_is_refused(dense_dir: Path, tmp_path: Path):
    quantized, dequantized = write_quantized(dense_dir, tmp_path / "q", "gptq", GROUP)
    config = json.loads((quantized / "config.json").read_text())
    (dequantized / "config.json").write_text(json.dumps(config))  # dense tensors, a config that says gptq
    with pytest.raises(ValueError, match="quantizes no layer"):
        load_model(str(dequantized))
