"""`--quantization gguf`: the bundled GGUF's own Q4_1 blocks as INT4 weights (quant/gguf_int4.py), read without
dequantizing: the same numbers gguf's own dequantizer gives, and the same greedy answers as the dense model."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import bundled_gguf_path
from services.gpu_worker.quant.gguf_int4 import q4_blocks_to_int4
from services.gpu_worker.quant.int4 import dequantize_int4
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.request import SamplingParams


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q4_blocks_hold_what_gguf_dequantizes(type_name: str):
    rng = np.random.default_rng(0)
    n, k = 6, 64
    dense = rng.standard_normal((n, k)).astype(np.float32)
    quant_type = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quantize(dense, quant_type)  # [N, K / 32 · block bytes] uint8
    want = gguf.dequantize(raw, quant_type).reshape(n, k)
    got = dequantize_int4(q4_blocks_to_int4(raw, type_name, n, k)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_other_block_types_are_refused():
    with pytest.raises(ValueError, match="Q8_0"):
        q4_blocks_to_int4(np.zeros((1, 34), np.uint8), "Q8_0", 1, 32)


def test_bundled_model_served_from_its_q4_blocks():
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    quantized = Engine(EngineConfig(model="bundled", device="cpu", quantization="gguf", num_pages=64))
    dense = Engine(EngineConfig(model="bundled", device="cpu", num_pages=64))
    layer = quantized.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.group_size == 32
    assert quantized.runner.num_quantized_layers == 30 * 7 and "GGUF" in quantized.weights
    got, want = quantized.generate(prompts, params), dense.generate(prompts, params)
    for g, w in zip(got, want):  # the dense weights are these blocks dequantized: the same model up to rounding
        assert g.samples[0].token_ids == w.samples[0].token_ids
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(g.samples[0].logprobs, w.samples[0].logprobs)]
        assert max(gaps) < 1e-3


def test_gguf_needs_the_bundled_model():
    with pytest.raises(ValueError, match="not the bundled model"):
        Engine(EngineConfig(model="random:tiny-llama", device="cpu", quantization="gguf", num_pages=16))
