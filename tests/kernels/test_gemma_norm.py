"""Gemma's (1 + w) RMSNorm kernels and the GELU(tanh)·mul against gemma2.py's torch modules."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.gemma_norm import gemma_post_norm_add, gemma_rms_norm
from services.gpu_worker.kernels.silu_mul import silu_mul, silu_mul_ref
from services.gpu_worker.model.gemma2 import GemmaRMSNorm
from tests.kernels.helpers import DEVICE, randn, rel_err

DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _norm(hidden: int, gen: torch.Generator, dtype: torch.dtype) -> GemmaRMSNorm:
    norm = GemmaRMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data = randn((hidden,), gen, dtype, DEVICE, scale=0.3)  # offsets from 1
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 3584), (5, 64), (3, 200)])
def test_norm_and_post_norm_add_equal_the_block(dtype, num_tokens, hidden):
    gen = torch.Generator().manual_seed(hidden)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    x, residual = (randn((num_tokens, hidden), gen, dtype, DEVICE, scale=2.0) for _ in range(2))
    post, following = _norm(hidden, gen, dtype), _norm(hidden, gen, dtype)
    assert rel_err(gemma_rms_norm(x, following.weight, 1e-6), following(x)) < tol
    want_res = residual + post(x)  # gemma2.Gemma2Layer: h + post_norm(out)
    got, got_res = gemma_post_norm_add(x, post.weight, residual, following.weight, 1e-6)
    assert rel_err(got_res, want_res) < tol
    assert rel_err(got, following(want_res)) < tol
    assert rel_err(gemma_rms_norm(x, torch.zeros_like(post.weight), 1e-6), post(x)) > 0.05  # the weight matters


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_equals_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    x = randn((4, 2 * 300), gen, dtype, DEVICE, scale=3.0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(silu_mul(x, gelu=True), silu_mul_ref(x, gelu=True)) < tol
    assert rel_err(silu_mul(x, gelu=True), silu_mul_ref(x)) > 0.01  # not SiLU
