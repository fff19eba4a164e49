"""FP8 W8A8 (services/gpu_worker/quant/fp8.py): rounding within e4m3's bound, the CPU path against the float matmul,
compressed-tensors loading and config recognition; the _scaled_mm path against the fallback on a GPU."""
from __future__ import annotations

import copy

import pytest
import torch

from services.gpu_worker.quant import fp8
from services.gpu_worker.quant.fp8 import (FP8_DTYPE, dequantize_fp8, fp8_linear, has_fp8_matmul,
                                           is_compressed_tensors_fp8, load_compressed_tensors_fp8,
                                           quantize_activation_fp8, quantize_weight_fp8)

# config.json's quantization_config of an llm-compressor FP8-Dynamic checkpoint
FP8_DYNAMIC_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                                  "num_bits": 8, "observer": None, "observer_kwargs": {}, "strategy": "token",
                                  "symmetric": True, "type": "float"},
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                        "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel",
                        "symmetric": True, "type": "float"},
        }
    },
    "format": "float-quantized",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _within_e4m3_bound(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
    """e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself; below the smallest normal (2^-6,
    in scaled units) the spacing is 2^-9, so within 2^-10 · scale."""
    err = (w.float() - dequantize_fp8(q, scale)).abs()
    bound = torch.maximum(w.float().abs() * 2.0 ** -4, scale.reshape(-1, 1) * 2.0 ** -10)
    return bool((err <= bound * (1 + 1e-6)).all())


def test_weight_quantization_is_per_channel_within_the_e4m3_bound() -> None:
    w = torch.randn(24, 40) * torch.logspace(-3, 2, 24)[:, None]  # [N, K] channels of very different ranges
    w[5] = 0.0  # an all-zero channel
    q, scale = quantize_weight_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == (24, 40)
    assert scale.dtype == torch.float32 and scale.shape == (24,)
    assert torch.allclose(scale[1], w[1].abs().max() / 448)
    assert scale[5] == 1.0 and (q[5].float() == 0).all()
    assert (q.float().abs().amax(dim=1)[scale != 1] == 448).all()  # each channel's amax hits e4m3's max
    assert _within_e4m3_bound(w, q, scale)


def test_activation_quantization_is_per_token_within_the_e4m3_bound() -> None:
    x = torch.randn(7, 32) * 50
    x[3] = 0.0
    qx, scale = quantize_activation_fp8(x)
    assert qx.shape == (7, 32) and scale.shape == (7, 1) and scale.dtype == torch.float32
    assert torch.isfinite(dequantize_fp8(qx, scale)).all()
    assert _within_e4m3_bound(x, qx, scale)


def test_fp8_linear_on_the_cpu_is_close_to_the_float_matmul_and_equals_its_own_math() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(5, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    qw, sw = quantize_weight_fp8(w)
    out = fp8_linear(x, qw, sw, bias)
    ref = x @ w.t() + bias
    assert out.shape == (5, 48) and out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 0.05  # two roundings of ≤ 2^-4 each, averaging out over K
    qx, sx = quantize_activation_fp8(x)
    assert torch.allclose(out, dequantize_fp8(qx, sx) @ dequantize_fp8(qw, sw).t() + bias)
    assert fp8_linear(x.bfloat16(), qw, sw).dtype == torch.bfloat16
    assert fp8_linear(x, qw, sw, out_dtype=torch.float16).dtype == torch.float16


def test_has_fp8_matmul_is_false_on_the_cpu() -> None:
    assert not has_fp8_matmul(torch.device("cpu"))


def test_compressed_tensors_per_channel_weight_loads_as_published() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -3.0]]).to(FP8_DTYPE)  # [N=2, K=3]
    q, scale = load_compressed_tensors_fp8(w, torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16))
    assert q.dtype == FP8_DTYPE and torch.equal(q.float(), w.float())
    assert scale.dtype == torch.float32 and scale.tolist() == [0.5, 2.0]
    assert dequantize_fp8(q, scale).tolist() == [[0.5, -1.0, 0.25], [896.0, 0.0, -6.0]]


@pytest.mark.parametrize("shape", [(), (1,)])
def test_compressed_tensors_per_tensor_scale_spreads_over_the_channels(shape: tuple[int, ...]) -> None:
    w = torch.ones(3, 4).to(FP8_DTYPE)
    _, scale = load_compressed_tensors_fp8(w, torch.full(shape, 0.25))
    assert scale.tolist() == [0.25] * 3


def test_compressed_tensors_loading_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError):
        load_compressed_tensors_fp8(torch.ones(3, 4), torch.ones(3, 1))  # not e4m3
    with pytest.raises(ValueError):
        load_compressed_tensors_fp8(torch.ones(3, 4).to(FP8_DTYPE), torch.ones(2, 1))


def test_fp8_dynamic_config_is_recognised_and_others_are_not() -> None:
    assert is_compressed_tensors_fp8(FP8_DYNAMIC_CONFIG)
    per_tensor = copy.deepcopy(FP8_DYNAMIC_CONFIG)
    per_tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    assert is_compressed_tensors_fp8(per_tensor)
    int8 = copy.deepcopy(FP8_DYNAMIC_CONFIG)
    int8["config_groups"]["group_0"]["weights"].update(num_bits=8, type="int")
    static_inputs = copy.deepcopy(FP8_DYNAMIC_CONFIG)
    static_inputs["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    w4a16 = copy.deepcopy(FP8_DYNAMIC_CONFIG)
    w4a16["format"] = "pack-quantized"
    for cfg in (int8, static_inputs, w4a16, {"quant_method": "awq", "bits": 4}, {}, None):
        assert not is_compressed_tensors_fp8(cfg)


def _cpu_scaled_mm() -> bool:
    """Whether this torch runs _scaled_mm on the CPU (recent versions do), so its call can be checked here."""
    one, q = torch.ones(()), torch.zeros(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(q, q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm")
@pytest.mark.parametrize("rowwise, out_dtype", [(True, torch.bfloat16), (False, torch.bfloat16),
                                                (False, torch.float16), (False, torch.float32)])
def test_the_scaled_mm_call_computes_the_fallbacks_numbers(rowwise: bool, out_dtype: torch.dtype) -> None:
    """The operand layout and the scales' shapes of the CUDA path, checked on torch's CPU _scaled_mm."""
    gen = torch.Generator().manual_seed(2)
    qx, sx = quantize_activation_fp8(torch.randn(5, 32, generator=gen) * 4)
    qw, sw = quantize_weight_fp8(torch.randn(16, 32, generator=gen))
    got = fp8._scaled_mm(qx, sx, qw, sw, out_dtype, rowwise)
    ref = dequantize_fp8(qx, sx) @ dequantize_fp8(qw, sw).t()
    assert got.dtype == out_dtype and got.shape == (5, 16)
    tolerance = 1e-2 if out_dtype == torch.bfloat16 else 1e-3
    assert (got.float() - ref).norm() / ref.norm() < tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_fp8_matmul(torch.device("cuda")),
                    reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_path_matches_the_dequantized_fallback(out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 256, generator=gen) * 3).cuda()
    qw, sw = quantize_weight_fp8(torch.randn(128, 256, generator=gen).cuda())
    got = fp8_linear(x, qw, sw, out_dtype=out_dtype)
    qx, sx = quantize_activation_fp8(x)
    ref = dequantize_fp8(qx, sx) @ dequantize_fp8(qw, sw).t()
    assert got.dtype == out_dtype
    tolerance = 1e-2 if out_dtype == torch.bfloat16 else 1e-3  # the output's rounding; fp32 accumulation either way
    assert (got.float() - ref).norm() / ref.norm() < tolerance
    assert fp8._scaled_mm_shapes_ok(qx, qw)
