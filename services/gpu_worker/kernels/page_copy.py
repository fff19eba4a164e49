"""Whole-page copies between paged KV pools (the same pool or another process's, opened over CUDA IPC).

One program per (page, layer, K or V) copies that page's contiguous [page_size, num_kv_heads, head_dim] block
from its source slot to its destination slot: every byte is read once and written once. The torch path it
replaces (index_select into a temporary, then index_copy_) moves each byte twice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _page_copy_kernel(src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_ids_ptr, dst_ids_ptr,
                      src_layer_stride, dst_layer_stride, PAGE_NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # which page of the list
    layer = tl.program_id(1).to(tl.int64)
    src_page = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_page = tl.load(dst_ids_ptr + i).to(tl.int64)
    src = layer * src_layer_stride + src_page * PAGE_NUMEL
    dst = layer * dst_layer_stride + dst_page * PAGE_NUMEL
    if tl.program_id(2) == 0:
        src_ptr, dst_ptr = src_k_ptr, dst_k_ptr
    else:
        src_ptr, dst_ptr = src_v_ptr, dst_v_ptr
    for start in tl.range(0, PAGE_NUMEL, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < PAGE_NUMEL
        tl.store(dst_ptr + dst + offs, tl.load(src_ptr + src + offs, mask=mask), mask=mask)


def copy_pages_(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor) -> None:
    """Pools [num_layers, num_pages, page_size, num_kv_heads, head_dim] (contiguous, one dtype); page ids [n] int.

    dst[:, dst_page_ids[i]] = src[:, src_page_ids[i]] for K and V. Destination pages must be distinct.
    """
    num_pages = src_page_ids.numel()
    if num_pages == 0:
        return
    for t in (dst_k, dst_v, src_k, src_v):
        assert t.is_contiguous() and t.dtype == dst_k.dtype and t.shape[0] == dst_k.shape[0]
    assert src_k.shape[2:] == dst_k.shape[2:] and src_k.shape == src_v.shape and dst_k.shape == dst_v.shape
    page_numel = dst_k[0, 0].numel()
    block = min(4096, triton.next_power_of_2(page_numel))
    _page_copy_kernel[(num_pages, dst_k.shape[0], 2)](
        src_k, src_v, dst_k, dst_v, src_page_ids, dst_page_ids, src_k.stride(0), dst_k.stride(0),
        PAGE_NUMEL=page_numel, BLOCK=block, num_warps=4)
