"""quantize_rows_fp8 (kernels/fp8_quant.py) against quant/fp8.quantize_activation_fp8's torch ops: the same scales
and, before the e4m3 cast, the same clamped x / scale (the interpreter's float8 conversion does not round as the GPU
does, so the CPU checks the values that are cast); on CUDA the same e4m3 bits."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.fp8_quant import FP8_MAX, quantize_rows_fp8
from services.gpu_worker.quant.fp8 import quantize_activation_fp8
from tests.kernels.helpers import DEVICE, gpu_only


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """[6, 1000]: magnitudes over five decades (an outlier-heavy token's spread), an all-zero row, a row of one value
    at ±FP8_MAX·8 and a row whose amax is in its last partial block."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=gen) * torch.logspace(-3, 2, 1000)
    x[2] = 0
    x[3] = FP8_MAX * 8
    x[3, ::2] *= -1
    x[4] = torch.randn(1000, generator=gen) * 1e-3
    x[4, -1] = 7.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [128, 512])
def test_scales_and_values_before_the_cast_match_the_torch_path(dtype: torch.dtype, block: int) -> None:
    x = _rows(dtype)
    values, scale = quantize_rows_fp8(x, block=block, out_dtype=torch.float32)
    _, want_scale = quantize_activation_fp8(x.cpu())
    assert scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(scale.cpu(), want_scale)
    assert scale[2].item() == 1.0  # an all-zero row
    want = (x.cpu().float() / want_scale).clamp(-FP8_MAX, FP8_MAX)
    assert torch.equal(values.cpu(), want)
    amax = values.abs().amax(dim=1).cpu()[[0, 1, 3, 4, 5]]
    assert torch.allclose(amax, torch.full_like(amax, FP8_MAX), rtol=1e-6)  # each row's amax lands on 448


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_e4m3_bits_match_the_torch_cast_on_cuda(dtype: torch.dtype) -> None:
    x = _rows(dtype)
    q, scale = quantize_rows_fp8(x)
    want_q, want_scale = quantize_activation_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
