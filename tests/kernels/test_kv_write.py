"""KV-cache write (slot scatter) vs index_copy_: exact."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.kv_write import kv_write, kv_write_ref
from tests.kernels.helpers import DEVICE, gpu_only, randn


def _check(num_tokens, num_pages, page_size, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(shape, gen, dtype, DEVICE), randn(shape, gen, dtype, DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv = randn((num_tokens, 2 * num_kv_heads, head_dim), gen, dtype, DEVICE)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided views of a fused projection
    slots = (torch.randperm(num_pages * page_size - page_size, generator=gen)[:num_tokens] + page_size).to(DEVICE)
    kv_write(k, v, k_cache, v_cache, slots.to(torch.int32))
    kv_write_ref(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_kv_write_small():
    _check(9, 6, 4, 2, 16, torch.float32)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 512, 4096])
def test_kv_write_llama8b_shapes(num_tokens):
    _check(num_tokens, 4096, 16, 8, 128, torch.bfloat16)
