"""Rotary embedding (rotate-half, HF layout) applied in place to q and k; cos/sin come from positions × inv_freq,
so llama3/linear scaling is whatever inv_freq already holds."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(ptr, stride_t, stride_h, t, cos, sin, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    base = ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, inv_freq_ptr, t, HALF: tl.constexpr):
    """Token t's rotation angles: cos and sin of position × inv_freq, each [1, D/2] fp32."""
    freqs = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + tl.arange(0, HALF))
    return tl.cos(freqs)[None, :], tl.sin(freqs)[None, :]


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0)
    cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, t, HALF)
    _rotate(q_ptr, stride_qt, stride_qh, t, cos, sin, num_q_heads, HALF, BLOCK_HQ)
    _rotate(k_ptr, stride_kt, stride_kh, t, cos, sin, num_k_heads, HALF, BLOCK_HK)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """In place. q: [T, H, D], k: [T, KVH, D] (head dim contiguous); positions: [T] int; inv_freq: [D/2] fp32."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    assert q.stride(2) == 1 and k.stride(2) == 1 and inv_freq.dtype == torch.float32
    _rope_kernel[(num_tokens,)](
        q, k, positions, inv_freq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_heads, k.shape[1],
        HALF=head_dim // 2, BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), num_warps=4)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's torch path (model.rope.cos_sin + apply_rope), out of place."""
    from services.gpu_worker.model.rope import apply_rope, cos_sin

    cos, sin = cos_sin(positions.long(), inv_freq, q.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
