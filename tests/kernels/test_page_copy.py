"""Whole-page copies between two paged pools vs index_select + index_copy_: exact, and nothing else touched."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.page_copy import copy_pages_
from tests.kernels.helpers import DEVICE, gpu_only, randn


def _check(num_layers, src_pages, dst_pages, page_size, num_kv_heads, head_dim, num_copy, dtype):
    gen = torch.Generator().manual_seed(num_copy)
    src_k = randn((num_layers, src_pages, page_size, num_kv_heads, head_dim), gen, dtype, DEVICE)
    src_v = randn(src_k.shape, gen, dtype, DEVICE)
    dst_k = randn((num_layers, dst_pages, page_size, num_kv_heads, head_dim), gen, dtype, DEVICE)
    dst_v = randn(dst_k.shape, gen, dtype, DEVICE)
    src_ids = torch.randint(0, src_pages, (num_copy,), generator=gen).to(DEVICE)  # repeats allowed
    dst_ids = torch.randperm(dst_pages, generator=gen)[:num_copy].to(DEVICE)
    ref_k, ref_v = dst_k.clone(), dst_v.clone()
    ref_k.index_copy_(1, dst_ids, src_k.index_select(1, src_ids))
    ref_v.index_copy_(1, dst_ids, src_v.index_select(1, src_ids))
    copy_pages_(dst_k, dst_v, src_k, src_v, src_ids.to(torch.int32), dst_ids.to(torch.int32))
    assert torch.equal(dst_k, ref_k) and torch.equal(dst_v, ref_v)


def test_page_copy_small():
    _check(3, 7, 9, 4, 2, 8, 5, torch.float32)


def test_page_copy_within_one_pool():
    """Copy-on-write inside a pool: source and destination pages of the same tensors."""
    gen = torch.Generator().manual_seed(3)
    k, v = randn((2, 6, 4, 2, 8), gen, torch.float32, DEVICE), randn((2, 6, 4, 2, 8), gen, torch.float32, DEVICE)
    want_k, want_v = k.clone(), v.clone()
    want_k[:, [4, 5]], want_v[:, [4, 5]] = k[:, [1, 2]], v[:, [1, 2]]
    ids = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    copy_pages_(k, v, k, v, ids([1, 2]), ids([4, 5]))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_copy", [1, 512, 2048])
def test_page_copy_llama8b_shapes(num_copy):
    _check(32, 2113, 2113, 16, 8, 128, num_copy, torch.bfloat16)
