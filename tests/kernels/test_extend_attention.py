"""Extend/prefill attention over a paged prefix plus new tokens (causal, variable lengths) vs its reference."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.extend_attention import extend_attention, extend_attention_ref
from tests.kernels.helpers import DEVICE, gpu_only, randn, random_paged_cache, rel_err


def _check(seq_lens, new_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, tol, block=64):
    gen = torch.Generator().manual_seed(sum(seq_lens) + sum(new_lens))
    k_cache, v_cache, table, lens = random_paged_cache(seq_lens, page_size, num_kv_heads, head_dim, dtype,
                                                       DEVICE, gen)
    query_start = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    q = randn((sum(new_lens), num_heads, head_dim), gen, dtype, DEVICE)
    out = extend_attention(q, k_cache, v_cache, query_start, lens, table, max(new_lens), block, block)
    ref = extend_attention_ref(q, k_cache, v_cache, query_start, lens, table)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize(("seq_lens", "new_lens"), [
    ([7], [7]),  # a whole prompt, no prefix
    ([40, 9, 23], [5, 9, 1]),  # cached prefixes + chunks, one sequence decoding inside a mixed batch
])
def test_extend_small(seq_lens, new_lens):
    _check(seq_lens, new_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
           dtype=torch.float32, tol=2e-3, block=16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize(("seq_lens", "new_lens"), [
    ([512] * 4, [512] * 4),
    ([2048, 700, 33, 1], [2048, 100, 33, 1]),
    ([4000, 1500], [512, 1500]),
])
def test_extend_llama8b_shapes(seq_lens, new_lens):
    _check(seq_lens, new_lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
           dtype=torch.bfloat16, tol=1e-2)
