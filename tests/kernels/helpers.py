"""Shared helpers of the kernel tests: the device, the error measure, random paged-cache layouts."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a NaN anywhere (e.g. an unwritten poisoned element) fails."""
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def randn(shape, gen: torch.Generator, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=device)


def random_paged_cache(seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: str, gen: torch.Generator):
    """K/V caches with each sequence's pages scattered at random (page 0 left as padding).

    Returns (k_cache, v_cache [P, S, KVH, D], page_table [B, max_pages] int32, seq_lens [B] int32)."""
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(shape, gen, dtype, device), randn(shape, gen, dtype, device)
    table = torch.zeros((len(seq_lens), max(pages_per_seq)), dtype=torch.int32)
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return k_cache, v_cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)
