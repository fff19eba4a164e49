"""RMSNorm fused with the residual add vs the model's torch RMSNorm."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.rms_norm import rms_norm, rms_norm_ref
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _check(num_tokens, hidden, dtype, tol, has_residual):
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = randn((num_tokens, hidden), gen, dtype, DEVICE)
    res = randn((num_tokens, hidden), gen, dtype, DEVICE) if has_residual else None
    w = randn((hidden,), gen, dtype, DEVICE, scale=0.1) + 1
    out, res_out = rms_norm(x, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    assert rel_err(out, ref) < tol
    assert torch.equal(res_out, ref_res)


@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_small(has_residual):
    _check(5, 48, torch.float32, 1e-5, has_residual)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_llama8b_shapes(num_tokens, has_residual):
    _check(num_tokens, 4096, torch.bfloat16, 1e-2, has_residual)


def _check_partials(num_parts, num_tokens, hidden, dtype):
    gen = torch.Generator().manual_seed(num_parts * 100 + num_tokens)
    parts = randn((num_parts, num_tokens, hidden), gen, torch.float32, DEVICE)
    res = randn((num_tokens, hidden), gen, dtype, DEVICE)
    w = randn((hidden,), gen, dtype, DEVICE, scale=0.1) + 1
    out, res_out = rms_norm(parts, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(parts, w, 1e-5, res)
    # the residual stream: the partials' sum rounded to the activation dtype, plus the residual (bit-equal
    # but for the fp32 summation order of the partials)
    assert res_out.dtype == dtype and res_out.shape == (num_tokens, hidden)
    assert rel_err(res_out, ref_res) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    # and not the first partial alone: the sum matters
    assert rel_err(res_out, (parts[0].to(dtype) + res)) > 0.1


def test_rms_norm_sums_split_k_partials():
    _check_partials(4, 3, 48, torch.float32)


def test_rms_norm_partials_need_a_residual():
    with pytest.raises(ValueError):
        rms_norm(torch.zeros((2, 1, 8), device=DEVICE), torch.ones(8, device=DEVICE), 1e-5)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_rms_norm_partials_llama8b_shapes(num_tokens):
    _check_partials(4, num_tokens, 4096, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim", [(1, 32, 4, 128), (5, 4, 2, 16), (3, 6, 6, 64)])
def test_rms_norm_heads_equals_the_models_norms_in_place(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    from services.gpu_worker.kernels.rms_norm import rms_norm_heads_
    from services.gpu_worker.model.llama import RMSNorm

    gen = torch.Generator().manual_seed(num_heads)
    qkv = randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), gen, dtype, DEVICE, scale=2.0)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE, dtype), RMSNorm(head_dim, 1e-6).to(DEVICE, dtype)
    q_norm.weight.data = randn((head_dim,), gen, dtype, DEVICE)
    k_norm.weight.data = randn((head_dim,), gen, dtype, DEVICE)
    want_q, want_k = q_norm(qkv[:, :num_heads]), k_norm(qkv[:, num_heads: num_heads + num_kv_heads])
    v = qkv[:, num_heads + num_kv_heads:].clone()
    rms_norm_heads_(qkv[:, :num_heads + num_kv_heads], q_norm.weight, k_norm.weight, num_heads, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: the order of the sum; bf16: an ulp
    assert rel_err(qkv[:, :num_heads], want_q) < tol
    assert rel_err(qkv[:, num_heads: num_heads + num_kv_heads], want_k) < tol
    assert torch.equal(qkv[:, num_heads + num_kv_heads:], v)  # v untouched
