"""QuantizedLinear (quant/linear.py), quantize_linears_ (quant/apply.py) and the quality measures (quant/quality.py):
one layer against the functions it wraps, then tiny random models whose logits stay close after quantization."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from services.gpu_worker.model.loader import load_model
from services.gpu_worker.model.registry import architecture_for_type
from services.gpu_worker.quant.apply import METHODS, quantize_linears_
from services.gpu_worker.quant.fp8 import FP8_DTYPE, fp8_linear
from services.gpu_worker.quant.int4 import from_awq, int4_linear, quantize_int4, to_awq
from services.gpu_worker.quant.linear import QuantizedLinear, int4_group_size
from services.gpu_worker.quant.quality import perplexity, sequence_logits, top1_agreement


def _dense(bias: bool = True, k: int = 64, n: int = 48) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(k, n, bias=bias)


def test_fp8_layer_is_fp8_linear_over_flattened_leading_dims() -> None:
    dense = _dense()
    layer = QuantizedLinear.from_linear(dense, "fp8")
    assert layer.qweight.dtype == FP8_DTYPE and layer.weight_scale.shape == (48,)
    assert {name for name, _ in layer.named_buffers()} == {"qweight", "weight_scale", "bias"}
    assert set(layer.state_dict()) == {"qweight", "weight_scale", "bias"}
    x = torch.randn(2, 3, 64)
    out = layer(x)
    assert out.shape == (2, 3, 48) and out.dtype == torch.float32
    assert torch.equal(out.reshape(6, 48), fp8_linear(x.reshape(6, 64), layer.qweight, layer.weight_scale, dense.bias))
    ref = dense(x)
    assert (out - ref).norm() / ref.norm() < 0.05
    assert "method=fp8" in repr(layer)


def test_int4_layer_is_int4_linear_and_keeps_x_dtype() -> None:
    dense = _dense(bias=False, k=128)
    layer = QuantizedLinear.from_linear(dense, "int4", group_size=64)
    assert layer.group_size == 64 and layer.bias is None and layer.perm is None
    assert layer.qweight.shape == (48, 16) and layer.scales.shape == layer.zeros.shape == (48, 2)
    x = torch.randn(5, 128)
    assert torch.equal(layer(x), int4_linear(x, layer.int4_weight()))
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    ref = dense(x)
    assert (layer(x) - ref).norm() / ref.norm() < 0.15
    moved = layer.to("meta")
    assert moved.qweight.device.type == "meta" and moved.scales.device.type == "meta"


def test_a_published_int4_weight_wraps_as_is() -> None:
    weight = quantize_int4(torch.randn(16, 64).half(), group_size=32)
    layer = QuantizedLinear.int4(from_awq(**to_awq(weight), group_size=32), bias=torch.ones(16).half())
    assert torch.equal(layer.qweight, weight.qweight) and layer.in_features == 64 and layer.out_features == 16
    x = torch.randn(3, 64).half()
    assert torch.equal(layer(x), int4_linear(x, weight, torch.ones(16).half()))


def test_unknown_methods_and_unpackable_group_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        QuantizedLinear.from_linear(_dense(), "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        quantize_linears_(nn.Sequential(_dense()), "int4")
    assert int4_group_size(576) == 64 and int4_group_size(1536) == 128 and int4_group_size(96, 32) == 32
    with pytest.raises(ValueError):
        int4_group_size(100)


def _tiny_model(preset_name: str) -> nn.Module:
    loaded = load_model(f"random:{preset_name}", dtype=torch.float32)
    model = architecture_for_type(loaded.config.arch).model_class(loaded.config, None)
    model.load_weights(loaded.state_dict)
    return model.eval()


_TOKENS = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(0)).tolist()


def test_sequence_logits_are_causal_and_the_measures_are_right() -> None:
    model = _tiny_model("tiny-llama")
    full = sequence_logits(model, _TOKENS)
    assert full.shape == (64, 512) and full.dtype == torch.float32
    assert torch.allclose(sequence_logits(model, _TOKENS[:20], page_size=8), full[:20], atol=1e-5)
    assert math.isclose(perplexity(torch.zeros(10, 512), list(range(10))), 512, rel_tol=1e-6)  # uniform: V
    sure = torch.full((4, 4), -30.0)
    sure[[0, 1, 2, 3], [1, 2, 3, 0]] = 30.0  # certain of the next token each time
    assert math.isclose(perplexity(sure, [0, 1, 2, 3]), 1.0, rel_tol=1e-6)
    assert top1_agreement(sure, sure) == 1.0 and top1_agreement(sure, -sure) == 0.0


# (preset, linears replaced: q k v o gate up down a layer, lm_head kept; the MoE layer's router kept)
@pytest.mark.parametrize("preset_name, replaced", [("tiny-llama", 14), ("tiny-qwen2", 14), ("tiny-qwen3-moe", 11)])
@pytest.mark.parametrize("method, max_rel_err, min_top1", [("fp8", 0.07, 0.9), ("awq", 0.2, 0.7), ("gptq", 0.2, 0.7)])
def test_a_quantized_tiny_model_stays_close_to_the_float_one(preset_name: str, replaced: int, method: str,
                                                             max_rel_err: float, min_top1: float) -> None:
    reference = sequence_logits(_tiny_model(preset_name), _TOKENS)
    model = _tiny_model(preset_name)
    assert quantize_linears_(model, method) == replaced
    assert not any(isinstance(m, nn.Linear) for name, m in model.named_modules()
                   if name != "lm_head" and not name.endswith("mlp.gate"))
    logits = sequence_logits(model, _TOKENS)
    assert (logits - reference).norm() / reference.norm() < max_rel_err
    assert top1_agreement(logits, reference) >= min_top1  # random weights: near-flat logits, near-ties flip


def test_skip_names_a_subtree_and_methods_are_listed() -> None:
    model = _tiny_model("tiny-llama")
    assert quantize_linears_(model, "fp8", skip=("lm_head", "mlp")) == 8  # attention only
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert {"fp8", "awq", "gptq"} <= set(METHODS)
