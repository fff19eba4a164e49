"""RoPE fused with the KV-cache write: one program per token rotates its q heads in place and writes its
rotated k heads and its v heads straight into their paged-cache slot (k itself is left as it was).

Replaces rope_ + kv_write on the Triton path: one launch per layer instead of two, and k is read once
instead of written back and read again. The stored values are bit-identical to rope_ then kv_write.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import v_pairs
from services.gpu_worker.kernels.rope import _cos_sin, _rotate
from services.gpu_worker.kv_cache import is_v_pairs


# positions[n:] and slot_mapping[n:] (after a mixed step's n leading decodes) start at any 8-byte boundary; one value
# of each is loaded per program, so their alignment is not specialized on (one compile for every n)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                          num_q_heads, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, V_PAIRS: tl.constexpr):
    t = tl.program_id(0)
    cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, t, HALF)
    _rotate(q_ptr, stride_qt, stride_qh, t, cos, sin, num_q_heads, HALF, BLOCK_HQ)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_HK)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    k_src = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    v_src = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    head_off = offs_h[:, None] * stride_ch + offs_d[None, :]
    dst = slot * stride_cs + head_off
    v_dst = v_pairs.v_offset(slot, head_off, stride_cs, V_PAIRS)
    V_STEP: tl.constexpr = 2 * HALF if V_PAIRS else HALF  # d + HALF: its byte lies 2 · HALF further in pairs
    k1 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
    # NOTE: round to k's dtype first, as rope_ does when it writes k back, then to the cache's
    out_ty = k_ptr.dtype.element_ty
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, (k1 * cos - k2 * sin).to(out_ty).to(cache_ty), mask=mask)
    tl.store(k_cache_ptr + dst + HALF, (k2 * cos + k1 * sin).to(out_ty).to(cache_ty), mask=mask)
    tl.store(v_cache_ptr + v_dst, tl.load(v_src, mask=mask).to(cache_ty), mask=mask)
    tl.store(v_cache_ptr + v_dst + V_STEP, tl.load(v_src + HALF, mask=mask).to(cache_ty), mask=mask)


def rope_kv_write_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """q: [T, H, D] rotated in place; k, v: [T, KVH, D] read; k_cache, v_cache: [P, S, KVH, D] (an FP8 V in key
    pairs: kv_cache.py) written at slot_mapping [T]; positions: [T] int; inv_freq: [D/2] fp32. Head dims
    contiguous."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    kc = k_cache.view(-1, num_kv_heads, head_dim)  # [P*S, KVH, D]
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and kc.stride() == vc.stride()
    assert inv_freq.dtype == torch.float32
    _rope_kv_write_kernel[(num_tokens,)](
        q, k, v, positions, inv_freq, slot_mapping, kc, vc, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), num_heads, NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2, BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads), V_PAIRS=is_v_pairs(v_cache.dtype), num_warps=4)
