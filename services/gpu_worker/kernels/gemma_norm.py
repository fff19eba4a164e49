"""Gemma's RMSNorm, y = norm(x) · (1 + w) computed in fp32 and rounded once, alone or fused with the post-norm and
residual add that precede the next pre-norm in a Gemma 2 block:

    r' = r + norm(x) · (1 + w_post)      (the post-norm's output rounded to the dtype, then the add rounded)
    y  = norm(r') · (1 + w_next)

so a layer's four norms take two launches (model/gemma2_fused.py). Same arithmetic as gemma2.GemmaRMSNorm and
the block's `h + post_norm(...)`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm(x32, w_ptr, offs, mask, hidden, eps):
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    return x32 * rstd * (1.0 + w)


@triton.jit
def _gemma_norm_kernel(x_ptr, res_ptr, w_post_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                       stride_ro, hidden, eps, HAS_POST: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_POST:
        post = _norm(x.to(tl.float32), w_post_ptr, offs, mask, hidden, eps).to(dtype)
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + post.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=mask)
    y = _norm(x.to(tl.float32), w_ptr, offs, mask, hidden, eps)
    tl.store(out_ptr + t * stride_o + offs, y.to(dtype), mask=mask)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] → norm(x) · (1 + weight), in x's dtype."""
    out = torch.empty_like(x)
    _launch(x, None, None, weight, out, None, eps)
    return out


def gemma_post_norm_add(x: torch.Tensor, post_weight: torch.Tensor, residual: torch.Tensor, next_weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden] → (norm(r') · (1 + next_weight), r') with r' = residual + norm(x) · (1 + post_weight)."""
    out, res_out = torch.empty_like(residual), torch.empty_like(residual)
    _launch(x, residual, post_weight, next_weight, out, res_out, eps)
    return out, res_out


def _launch(x, residual, post_weight, weight, out, res_out, eps) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    assert x.stride(1) == 1
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    _gemma_norm_kernel[(num_tokens,)](
        x, res, post_weight if post_weight is not None else weight, weight, out,
        res_out if res_out is not None else out, x.stride(0), res.stride(0), out.stride(0),
        (res_out if res_out is not None else out).stride(0), hidden, eps, HAS_POST=residual is not None,
        BLOCK=block, num_warps=min(16, max(1, block // 256)))
