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
