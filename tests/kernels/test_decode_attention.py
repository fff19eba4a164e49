"""Paged decode attention (split-K, GQA) vs its fp32 torch reference."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.decode_attention import decode_attention, decode_attention_ref, num_splits_for
from tests.kernels.helpers import DEVICE, gpu_only, randn, random_paged_cache, rel_err


def _check(seq_lens, num_heads, num_kv_heads, head_dim, page_size, num_splits, dtype, tol, device=DEVICE):
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_splits)
    k_cache, v_cache, table, lens = random_paged_cache(seq_lens, page_size, num_kv_heads, head_dim, dtype,
                                                       device, gen)
    q = randn((len(seq_lens), num_heads, head_dim), gen, dtype, device)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, table, lens, num_splits, out=out)
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("seq_lens", [[1, 5, 37], [130]])
def test_decode_small(seq_lens, num_splits):
    _check(seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_splits=num_splits,
           dtype=torch.float32, tol=2e-3)


def test_decode_more_splits_than_keys():
    _check([3, 70], num_heads=2, num_kv_heads=1, head_dim=16, page_size=16, num_splits=8,
           dtype=torch.float32, tol=2e-3)


def test_num_splits_fills_the_chip():
    assert num_splits_for(1, 8, 132) == 32
    assert num_splits_for(128, 8, 132) == 1
    assert num_splits_for(16, 8, 132) == 4


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("seq_lens", [[1], [17, 512, 1000, 3], [4096] * 8, list(range(1, 2000, 61))])
@pytest.mark.parametrize("num_splits", [1, 8, 32])
def test_decode_llama8b_shapes(seq_lens, num_splits):
    _check(seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, num_splits=num_splits,
           dtype=torch.bfloat16, tol=1e-2)
