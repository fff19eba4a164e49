"""RoPE in place on q and k (llama3-scaled inv_freq) vs the model's torch rotary path."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.rope import rope_, rope_ref
from services.gpu_worker.model.presets import preset
from services.gpu_worker.model.rope import inv_frequencies
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _check(num_tokens, num_heads, num_kv_heads, head_dim, dtype, tol, max_pos):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    cfg = preset("llama3-8b")
    inv_freq = inv_frequencies(head_dim, cfg.rope_theta, cfg.rope_scaling).to(DEVICE)
    qkv = randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), gen, dtype, DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]  # strided views, as the model has
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    v_before = qkv[:, num_heads + num_kv_heads:].clone()
    rope_(q, k, positions, inv_freq)
    assert rel_err(q, ref_q) < tol and rel_err(k, ref_k) < tol
    assert torch.equal(qkv[:, num_heads + num_kv_heads:], v_before)  # v untouched


def test_rope_small():
    _check(6, 4, 2, 16, torch.float32, 1e-5, 5000)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 300, 8192])
def test_rope_llama8b_shapes(num_tokens):
    _check(num_tokens, 32, 8, 128, torch.bfloat16, 1e-2, 131072)
