"""Fused SiLU·mul vs torch's silu(gate) * up."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.silu_mul import silu_mul, silu_mul_ref
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _check(num_tokens, inter, dtype, tol, block=1024):
    gen = torch.Generator().manual_seed(num_tokens + inter)
    x = randn((num_tokens, 2 * inter), gen, dtype, DEVICE)
    assert rel_err(silu_mul(x, block), silu_mul_ref(x)) < tol


def test_silu_mul_small():
    _check(3, 40, torch.float32, 1e-6, block=16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_silu_mul_llama8b_shapes(num_tokens):
    _check(num_tokens, 14336, torch.bfloat16, 1e-2)
