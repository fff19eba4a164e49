"""Fused gated activation of the MLP: [T, 2I] gate|up (one fused projection) → act(gate) * up, [T, I]; act is SiLU
(Llama) or GELU with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, inter, GELU: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    t = tl.program_id(0)
    pdl.wait(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # NOTE: the activation is rounded to the output dtype before the product, as torch's two-op reference does.
    if GELU:  # 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))), tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, block: int = 1024, gelu: bool = False) -> torch.Tensor:
    """x: [T, 2I] (gate then up) → [T, I]: silu(gate) · up, or gelu_tanh(gate) · up when gelu."""
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    assert x.stride(1) == 1
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block, num_warps=4, **pdl.args(x.device))
    return out


def silu_mul_ref(x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
