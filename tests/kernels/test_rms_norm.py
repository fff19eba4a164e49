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
