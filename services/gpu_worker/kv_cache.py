"""The paged KV tensors: one K and one V page array per layer, addressed by slot = page_id * page_size + offset.

The cache may hold a narrower dtype than the model computes in: FP8 (e4m3, no scale: values round to the
nearest of its 3 mantissa bits and saturate at ±448) halves the bytes of every page, so the pool holds twice
the tokens and decode attention reads half the bytes. Readers convert to the compute dtype as they load.
"""
from __future__ import annotations

import torch

from services.gpu_worker.staging import to_device


class KVCache:
    """K and V of every layer in fixed-size pages.

    Layout: `k[layer]` and `v[layer]` are `[num_pages, page_size, num_kv_heads, head_dim]`; page 0 is
    reserved padding (the block pool never hands it out), so a zero-padded page table is always valid.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, S, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, S, KVH, D]
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's new K/V rows. slot_mapping: [T] int64; k, v: [T, KVH, D]."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        raw(self.k[layer]).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw(k.to(self.dtype)))
        raw(self.v[layer]).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw(v.to(self.dtype)))

    def copy_pages(self, src_page_ids: list[int], dst_page_ids: list[int]) -> None:
        """Copy whole pages across all layers (copy-on-write of a shared partial page)."""
        src = to_device(src_page_ids, torch.long, self.k.device)
        dst = to_device(dst_page_ids, torch.long, self.k.device)
        for pool in (self.k, self.v):
            raw(pool).index_copy_(1, dst, raw(select_pages(pool, src)))


FP8_DTYPES = (torch.float8_e4m3fn,)


def raw(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8 (same bytes), for the indexing ops torch lacks for FP8 on the CPU;
    other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def select_pages(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool [L, P, S, KVH, D] → its pages `index` (int64, on pool's device), [L, len(index), S, KVH, D], any dtype."""
    return raw(pool).index_select(1, index).view(pool.dtype)
