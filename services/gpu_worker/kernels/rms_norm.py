"""RMSNorm, optionally fused with the residual add that precedes it: r = x + residual; y = norm(r) · w.

x may also come as S split-K partial products [S, T, hidden] fp32 of the projection before it (model/fused.py
splits the K dimension of o_proj and down_proj at small batches): the kernel sums them and rounds the sum to the
activation dtype, as cuBLAS's own split-K reduction would write it, before the residual add.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_part, stride_x, stride_r, stride_o,
                     stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, NUM_PARTS: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    if NUM_PARTS == 1:
        x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for part in tl.static_range(NUM_PARTS):
            acc += tl.load(x_ptr + part * stride_part + t * stride_x + offs, mask=mask, other=0.0)
        x = acc.to(out_ptr.dtype.element_ty)  # the projection's output as cuBLAS would have written it
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
        # NOTE: the sum is rounded to the activation dtype first, like torch's `h = h + attn`.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    y = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + t * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden] → (norm(x + residual) · weight, x + residual); without residual, (norm(x) · w, x).

    x may be split-K partials [S, T, hidden] fp32 (then residual is required; x := their sum in its dtype)."""
    parts = x if x.dim() == 3 else x.unsqueeze(0)  # [S, T, hidden]
    num_parts, num_tokens, hidden = parts.shape
    if num_parts > 1 and residual is None:
        raise ValueError("split-K partials need the residual they are added to")
    like = residual if num_parts > 1 else x
    out = torch.empty_like(like)
    res_out = torch.empty_like(like) if residual is not None else x
    if num_tokens == 0:
        return out, res_out
    assert parts.stride(2) == 1
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        parts, res, weight, out, res_out, parts.stride(0), parts.stride(1), res.stride(0), out.stride(0),
        res_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, NUM_PARTS=num_parts, BLOCK=block,
        num_warps=num_warps or min(16, max(1, block // 256)))
    return out, res_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's torch RMSNorm (llama.RMSNorm) after a plain residual add (split-K partials: summed, then
    rounded to the residual's dtype)."""
    if x.dim() == 3:
        x = x.sum(0).to(residual.dtype)
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


@triton.jit
def sum_squares(x, ROWS: tl.constexpr, N: tl.constexpr):
    """Σ x² of each row of x [ROWS, N] fp32 (N a power of two) → [ROWS], by a fixed tree: x₀² + x₁², x₂² + x₃², …,
    then the sums of neighbouring pairs of those, and so on.

    NOTE: each step adds two numbers, which commute, so the bits do not depend on which thread holds which element.
    tl.sum's order does (it follows the layout Triton picks for the kernel), and the kernels that must norm a head to
    the same bits (rms_norm_heads_, decode_attention_rope's head norm) differ in layout. The first step is an explicit
    fma of the pair's first element (the pair's order, not the layout's): with FP fusion on, the compiler would
    contract `a·a + b·b` into either fma.

    NOTE: the order costs time. On the H100, rms_norm_heads_ over Qwen3-30B-A3B's 36 heads took 2.6 µs at one token,
    3.8 at 64 and 47.1 at 2048 (in a CUDA graph), against 2.4, 3.2 and 46.2 with the tl.sum it had before (the same
    kernel with tl.sum: 2.5, 3.4, 46.3)."""
    a, b = tl.split(tl.reshape(x, [ROWS, N // 2, 2]))
    x = tl.fma(a, a, b * b)
    for i in tl.static_range(2, 16):  # N ≤ 2¹⁵
        if (N >> i) > 0:
            a, b = tl.split(tl.reshape(x, [ROWS, N >> i, 2]))
            x = a + b
    return tl.reshape(x, [ROWS])


@triton.jit
def head_rstd(x32, n, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """1 / RMS of each row of x32 [ROWS, BLOCK] fp32 (zeros past n) → [ROWS], as llama.RMSNorm's
    rsqrt(mean(x²) + eps)."""
    return 1.0 / tl.sqrt(sum_squares(x32, ROWS, BLOCK) / n + eps)


@triton.jit
def head_scale(x, rstd, w):
    """x · rstd rounded to x's dtype, times the weight w, rounded again: llama.RMSNorm's `weight * x32.to(x.dtype)`."""
    return ((x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(x.dtype)


@triton.jit
def _rms_norm_heads_kernel(q_ptr, k_ptr, q_w_ptr, k_w_ptr, stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads,
                           head_dim, eps, BLOCK: tl.constexpr):
    t, head = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    if head < num_q_heads:
        ptrs = q_ptr + t.to(tl.int64) * stride_qt + head * stride_qh + offs
        w = tl.load(q_w_ptr + offs, mask=mask, other=0.0)
    else:
        ptrs = k_ptr + t.to(tl.int64) * stride_kt + (head - num_q_heads) * stride_kh + offs
        w = tl.load(k_w_ptr + offs, mask=mask, other=0.0)
    x = tl.load(ptrs, mask=mask, other=0.0)
    rstd = head_rstd(x.to(tl.float32)[None, :], head_dim, eps, 1, BLOCK)  # [1]
    tl.store(ptrs, head_scale(x, rstd, w), mask=mask)


def rms_norm_qk_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float) -> None:
    """Qwen3-style q/k norms in place, one launch: each head of q [T, H, D] normed with q_weight [D], each of
    k [T, KVH, D] with k_weight [D], as the model's torch RMSNorm (llama.RMSNorm) computes it (the sum of squares
    by sum_squares' tree)."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and k.shape[0] == num_tokens and k.shape[2] == head_dim
    if num_tokens:
        _rms_norm_heads_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_q_heads, head_dim, eps,
            BLOCK=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2)


def rms_norm_heads_(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                    eps: float) -> torch.Tensor:
    """Qwen3-style q/k norms in place, one launch: qk [T, H + KVH, D] (a view of the fused q/k/v projection's
    output), the first num_q_heads heads normed with q_weight [D], the rest with k_weight [D]; each head as the
    model's torch RMSNorm (llama.RMSNorm) computes it."""
    rms_norm_qk_(qk[:, :num_q_heads], qk[:, num_q_heads:], q_weight, k_weight, eps)
    return qk
