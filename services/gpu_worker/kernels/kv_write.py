"""KV-cache write: scatter this step's new K/V rows into the paged cache by slot."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import v_pairs
from services.gpu_worker.kv_cache import is_v_pairs, write_slots


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     V_PAIRS: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    head_off = offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + slot * stride_cs + head_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_pairs.v_offset(slot, head_off, stride_cs, V_PAIRS), v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] (head dim contiguous); k_cache, v_cache: [P, S, KVH, D] (an FP8 V in key pairs:
    kv_cache.py); slot_mapping: [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    kc = k_cache.view(-1, num_kv_heads, head_dim)  # [P*S, KVH, D]
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    assert k.stride(2) == 1 and v.stride(2) == 1 and kc.stride() == vc.stride()
    _kv_write_kernel[(num_tokens,)](
        k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), V_PAIRS=is_v_pairs(v_cache.dtype))


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    write_slots(k_cache, v_cache, slot_mapping.long(), k, v)
