"""Greedy decoding's row-wise argmax over the vocabulary in two launches: each program takes one block of one
row (its max and the first index reaching it), then one program per row picks the first block holding the
row's max. Same result as torch.argmax(dim=-1) — the first index of the maximum — but spread over
⌈V / BLOCK⌉ programs per row: at batch 1 torch's reduction runs one row on one block (27.5 µs on the H200
for a 128k vocabulary).

NaN counts as larger than every number (torch's rule); a row's first NaN or +inf wins.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl


@triton.jit
def _block_max_kernel(x_ptr, stride_row, num_cols, vals_ptr, idx_ptr, num_blocks, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    pdl.wait(PDL)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + offs, mask=offs < num_cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks above every number, as in torch.argmax
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, offs, num_cols), axis=0)  # the first index reaching the max
    tl.store(vals_ptr + row * num_blocks + block, best)
    tl.store(idx_ptr + row * num_blocks + block, first)


@triton.jit
def _pick_block_kernel(vals_ptr, idx_ptr, num_blocks, out_ptr, NUM_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    pdl.wait(PDL)
    offs = tl.arange(0, NUM_BLOCKS)
    mask = offs < num_blocks
    vals = tl.load(vals_ptr + row * num_blocks + offs, mask=mask, other=float("-inf"))
    best = tl.max(vals, axis=0)
    first_block = tl.min(tl.where((vals == best) & mask, offs, num_blocks), axis=0)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_blocks + first_block))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 2048) -> torch.Tensor:
    """x: [B, V] (fp32/bf16/fp16, unit stride along V) → [B] int64, torch.argmax(x, dim=-1)'s values.

    out: a [B] int64 tensor to write into (a CUDA graph's static output)."""
    num_rows, num_cols = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device) if out is None else out
    if num_rows == 0:
        return out
    if num_cols == 0:
        raise ValueError("argmax of an empty row")
    assert x.stride(1) == 1 and out.shape == (num_rows,) and out.dtype == torch.int64
    num_blocks = triton.cdiv(num_cols, block)
    vals = torch.empty((num_rows, num_blocks), dtype=torch.float32, device=x.device)
    idx = torch.empty((num_rows, num_blocks), dtype=torch.int64, device=x.device)
    _block_max_kernel[(num_rows, num_blocks)](x, x.stride(0), num_cols, vals, idx, num_blocks, BLOCK=block,
                                              num_warps=8, **pdl.args(x.device))
    _pick_block_kernel[(num_rows,)](vals, idx, num_blocks, out, NUM_BLOCKS=triton.next_power_of_2(num_blocks),
                                    num_warps=4, **pdl.args(x.device))
    return out


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
