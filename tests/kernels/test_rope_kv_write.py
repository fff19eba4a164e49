"""RoPE fused with the KV write vs rope_ then kv_write (and the torch reference): the same bits."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.kv_write import kv_write_ref
from services.gpu_worker.kernels.rope import rope_ref
from services.gpu_worker.kernels.rope_kv_write import rope_kv_write_
from services.gpu_worker.model.presets import preset
from services.gpu_worker.model.rope import inv_frequencies
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _check(num_tokens, num_heads, num_kv_heads, head_dim, num_pages, page_size, dtype, tol):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    cfg = preset("llama3-8b")
    inv_freq = inv_frequencies(head_dim, cfg.rope_theta, cfg.rope_scaling).to(DEVICE)
    qkv = randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), gen, dtype, DEVICE)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen).to(DEVICE)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(shape, gen, dtype, DEVICE), randn(shape, gen, dtype, DEVICE)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    slots = (torch.randperm(num_pages * page_size - page_size, generator=gen)[:num_tokens] + page_size).to(DEVICE)
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    k_before = k.clone()
    kv_write_ref(ref_k, v, ref_k_cache, ref_v_cache, slots)

    rope_kv_write_(q, k, v, positions, inv_freq, k_cache, v_cache, slots.to(torch.int32))
    assert rel_err(q, ref_q) < tol
    assert torch.equal(k, k_before)  # k itself is read, not rotated
    assert torch.equal(v_cache, ref_v_cache)
    assert rel_err(k_cache, ref_k_cache) < tol
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[untouched],
                       ref_k_cache.view(-1, num_kv_heads, head_dim)[untouched])


def _check_same_bits_as_unfused(num_tokens, dtype):
    """On the device path the fused kernel stores exactly what rope_ then kv_write store."""
    from services.gpu_worker.kernels.kv_write import kv_write
    from services.gpu_worker.kernels.rope import rope_

    gen = torch.Generator().manual_seed(7)
    inv_freq = inv_frequencies(128, 500000.0, preset("llama3-8b").rope_scaling).to(DEVICE)
    qkv = randn((num_tokens, 48, 128), gen, dtype, DEVICE)
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen).to(DEVICE)
    caches = [torch.zeros((64, 16, 8, 128), dtype=dtype, device=DEVICE) for _ in range(4)]
    slots = (torch.randperm(63 * 16, generator=gen)[:num_tokens] + 16).to(torch.int32).to(DEVICE)
    fused = qkv.clone()
    rope_kv_write_(fused[:, :32], fused[:, 32:40], fused[:, 40:], positions, inv_freq, caches[0], caches[1], slots)
    rope_(qkv[:, :32], qkv[:, 32:40], positions, inv_freq)
    kv_write(qkv[:, 32:40], qkv[:, 40:], caches[2], caches[3], slots)
    assert torch.equal(fused[:, :32], qkv[:, :32])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rope_kv_write_small():
    _check(7, 4, 2, 16, 6, 4, torch.float32, 1e-5)


def test_rope_kv_write_same_bits_as_rope_then_kv_write():
    _check_same_bits_as_unfused(5, torch.float32)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 300, 4096])
def test_rope_kv_write_llama8b_shapes(num_tokens):
    _check(num_tokens, 32, 8, 128, 4096, 16, torch.bfloat16, 1e-2)
    _check_same_bits_as_unfused(min(num_tokens, 63 * 16), torch.bfloat16)
