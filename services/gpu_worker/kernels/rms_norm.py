"""RMSNorm, optionally fused with the residual add that precedes it: r = x + residual; y = norm(r) · w.

x may also come as S split-K partial products [S, T, hidden] fp32 of the projection before it (model/fused.py
splits the K dimension of o_proj and down_proj at small batches): the kernel sums them and rounds the sum to the
activation dtype, as cuBLAS's own split-K reduction would write it, before the residual add.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_part, stride_x, stride_r, stride_o,
                     stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, NUM_PARTS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl.wait(PDL)
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
        num_warps=num_warps or min(16, max(1, block // 256)), **pdl.args(x.device))
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
def _rms_norm_heads_kernel(x_ptr, q_w_ptr, k_w_ptr, stride_t, stride_h, num_q_heads, head_dim, eps,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    t, head = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    ptrs = x_ptr + t.to(tl.int64) * stride_t + head * stride_h + offs
    w_ptr = q_w_ptr if head < num_q_heads else k_w_ptr
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.wait(PDL)
    x = tl.load(ptrs, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / head_dim + eps)
    y = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=mask)


def rms_norm_heads_(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                    eps: float) -> torch.Tensor:
    """Qwen3-style q/k norms in place, one launch: qk [T, H + KVH, D] (a view of the fused q/k/v projection's
    output), the first num_q_heads heads normed with q_weight [D], the rest with k_weight [D]; each head as the
    model's torch RMSNorm (llama.RMSNorm) computes it."""
    num_tokens, num_heads, head_dim = qk.shape
    assert qk.stride(2) == 1
    if num_tokens:
        _rms_norm_heads_kernel[(num_tokens, num_heads)](
            qk, q_weight, k_weight, qk.stride(0), qk.stride(1), num_q_heads, head_dim, eps,
            BLOCK=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2, **pdl.args(qk.device))
    return qk
