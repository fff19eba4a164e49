"""Fused SiLU·mul of the MLP: [T, 2I] gate|up (one fused projection) → silu(gate) * up, [T, I]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl



@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # NOTE: silu is rounded to the output dtype before the product, as torch's two-op reference does.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x: [T, 2I] (gate then up) → [T, I]."""
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    assert x.stride(1) == 1
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
