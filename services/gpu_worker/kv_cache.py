"""The paged KV tensors: one K and one V page array per layer, addressed by slot = page_id * page_size + offset.

The cache may hold a narrower dtype than the model computes in: FP8 (e4m3, no scale: values round to the
nearest of its 3 mantissa bits and saturate at ±448) halves the bytes of every page, so the pool holds twice
the tokens and decode attention reads half the bytes. Readers convert to the compute dtype as they load.

An FP8 V cache stores its keys in pairs (is_v_pairs): within a page, rows 2j and 2j + 1 are interleaved byte by
byte, [S/2, KVH, D, 2] in place of [S, KVH, D]. Attention multiplies P [queries, keys] by V [keys, D], and the
tensor cores take V with two consecutive keys per 32-bit register: from 8-bit rows (D contiguous) the kernel
gathers those byte by byte from shared memory; from pairs one 16-bit transposed read serves two keys. On the H200
the decode attention at 384 sequences × 1504 keys (32 layers) took 11.32 ms over rows, 11.06 over pairs and 10.75
over pairs with v_pairs.py's unpacking assembly, the default (docs/PERFORMANCE.md, levers tried). K is read as rows (Q·Kᵀ wants D
contiguous). Pages still move whole (prefix copies, PD transfers), and both ends of a transfer share the dtype,
hence the layout. v_rows() gives the rows back, for the torch paths and the references.
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
        check_page_size(dtype, page_size)
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
        write_slots(self.k[layer], self.v[layer], slot_mapping, k, v)

    def copy_pages(self, src_page_ids: list[int], dst_page_ids: list[int]) -> None:
        """Copy whole pages across all layers (copy-on-write of a shared partial page)."""
        src = to_device(src_page_ids, torch.long, self.k.device)
        dst = to_device(dst_page_ids, torch.long, self.k.device)
        for pool in (self.k, self.v):
            raw(pool).index_copy_(1, dst, raw(select_pages(pool, src)))


FP8_DTYPES = (torch.float8_e4m3fn,)


def is_v_pairs(dtype: torch.dtype) -> bool:
    """Whether a V cache of this dtype stores its keys in pairs (the module's docstring): FP8 ones do."""
    return dtype in FP8_DTYPES


def check_page_size(dtype: torch.dtype, page_size: int) -> None:
    """Raises ValueError where a cache of this dtype cannot have pages of this size (key pairs need an even one)."""
    if is_v_pairs(dtype) and page_size % 2:
        raise ValueError(f"an FP8 KV cache stores V in key pairs: page_size must be even, not {page_size}")


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """k, v [T, KVH, D] cast to the caches' dtype into slots slot_mapping [T] (int64) of k_cache, v_cache
    [P, S, KVH, D]; V in key pairs where the dtype says so."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    raw(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw(k.to(k_cache.dtype)))
    v = raw(v.to(v_cache.dtype))
    if is_v_pairs(v_cache.dtype):  # [P, S/2, KVH, D, 2]: slot s lies in pair row s // 2, at byte s % 2
        raw(v_cache).view(-1, num_kv_heads, head_dim, 2)[slot_mapping // 2, :, :, slot_mapping % 2] = v
    else:
        raw(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def v_rows(v: torch.Tensor) -> torch.Tensor:
    """A V cache [..., P, S, KVH, D] as rows (a copy): key pairs are de-interleaved; other dtypes are as they are."""
    if not is_v_pairs(v.dtype):
        return v
    *lead, page_size, num_kv_heads, head_dim = v.shape
    pairs = raw(v).reshape(*lead, page_size // 2, num_kv_heads, head_dim, 2)
    return pairs.movedim(-1, -3).reshape(v.shape).view(v.dtype)


def v_pairs_of(rows: torch.Tensor) -> torch.Tensor:
    """The inverse of v_rows: an FP8 V cache of rows [..., P, S, KVH, D] in key pairs (a copy)."""
    if not is_v_pairs(rows.dtype):
        return rows
    *lead, page_size, num_kv_heads, head_dim = rows.shape
    split = raw(rows).reshape(*lead, page_size // 2, 2, num_kv_heads, head_dim)
    return split.movedim(-3, -1).reshape(rows.shape).view(rows.dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8 (same bytes), for the indexing ops torch lacks for FP8 on the CPU;
    other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def select_pages(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool [L, P, S, KVH, D] → its pages `index` (int64, on pool's device), [L, len(index), S, KVH, D], any dtype."""
    return raw(pool).index_select(1, index).view(pool.dtype)
