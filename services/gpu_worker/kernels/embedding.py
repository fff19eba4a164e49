"""The token embedding of a decode step whose input tokens are partly still on the device.

In overlap mode a step is queued before the host has read the previous step's sampled tokens, so some input
ids are placeholders. Row i embeds `prev[src[i]]` when src[i] ≥ 0 (the previous step's sampled token at row
src[i], still on the device) and `ids[i]` otherwise. One kernel, so a captured decode graph takes its inputs
from the previous replay's tokens without any kernel before it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _embedding_fed_kernel(weight_ptr, ids_ptr, src_ptr, prev_ptr, out_ptr, hidden, stride_w, stride_o,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(src_ptr + row).to(tl.int64)
    own = tl.load(ids_ptr + row).to(tl.int64)
    fed = tl.load(prev_ptr + tl.maximum(src, 0)).to(tl.int64)
    token = tl.where(src >= 0, fed, own)
    mask = offs < hidden
    vals = tl.load(weight_ptr + token * stride_w + offs, mask=mask)
    tl.store(out_ptr + row * stride_o + offs, vals, mask=mask)


def embedding_fed(weight: torch.Tensor, ids: torch.Tensor, src: torch.Tensor, prev: torch.Tensor,
                  block: int = 1024) -> torch.Tensor:
    """weight [V, H]; ids, src [T] int32/int64; prev [P] int64 → [T, H]: weight[prev[src]] where src ≥ 0,
    weight[ids] elsewhere. Token ids must be in [0, V) (the engine validates prompts; samples are in range)."""
    num_tokens, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    assert weight.stride(1) == 1 and src.shape == ids.shape
    _embedding_fed_kernel[(num_tokens, triton.cdiv(hidden, block))](
        weight, ids, src, prev, out, hidden, weight.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def embedding_fed_ref(weight: torch.Tensor, ids: torch.Tensor, src: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    tokens = torch.where(src >= 0, prev[src.clamp_min(0).long()], ids.long())
    return weight[tokens]
