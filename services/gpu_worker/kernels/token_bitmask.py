"""Structured output's token mask applied to the logits in one launch: logits[rows[r], v] = -inf where bit v % 32 of
bitmask[r, v // 32] is 0 (v < V; ids in [V, 32·W) are ignored).

Each program takes one block of one constrained row: it loads the block's WORDS bitmask words once, expands them
to a [WORDS, 32] tile of bits and stores -inf where a bit is clear. The logits are never read and allowed ones
never written, so the traffic is the bitmask (V / 8 bytes a row) plus the disallowed logits' stores, where the
torch ops it replaces (an [R, W, 32] expansion, a gather of the rows, masked_fill, an index_put) moved the rows
several times over.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BITS = 32  # tokens per bitmask word


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_row, stride_col, vocab, bitmask_ptr, stride_mask, num_words,
                                rows_ptr, WORDS: tl.constexpr):
    r = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    words = block * WORDS + tl.arange(0, WORDS)  # [WORDS]
    mask_words = tl.load(bitmask_ptr + r.to(tl.int64) * stride_mask + words, mask=words < num_words, other=-1)
    bit = tl.arange(0, 32)  # [32]
    allowed = ((mask_words[:, None] >> bit[None, :]) & 1) != 0  # [WORDS, 32]; >> keeps the sign, & 1 drops it
    ids = words[:, None] * 32 + bit[None, :]  # [WORDS, 32]
    ptrs = logits_ptr + row * stride_row + ids.to(tl.int64) * stride_col
    neg_inf = tl.full([WORDS, 32], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(ptrs, neg_inf, mask=(ids < vocab) & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                         block: int = 4096) -> torch.Tensor:
    """In place: logits [B, V] (fp32/bf16/fp16, any strides), bitmask [R, W] int32 (W·32 ≥ V, unit stride along W),
    rows [R] int32/int64 (the logit row of each bitmask row; distinct, any order), all on one device → logits.

    block: tokens per program, a power of two ≥ 32."""
    num_rows = rows.shape[0]
    vocab = logits.shape[1]
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32
    assert bitmask.shape[0] == num_rows and bitmask.shape[1] * BITS >= vocab and bitmask.stride(1) == 1
    assert rows.dim() == 1 and rows.dtype in (torch.int32, torch.int64)
    assert block >= BITS and block & (block - 1) == 0
    if num_rows == 0 or vocab == 0:
        return logits
    words = block // BITS
    grid = (num_rows, triton.cdiv(vocab, block))
    _apply_token_bitmask_kernel[grid](logits, logits.stride(0), logits.stride(1), vocab, bitmask, bitmask.stride(0),
                                      bitmask.shape[1], rows, WORDS=words, num_warps=4)
    return logits
