"""FP8 W8A8's dynamic per-token activation quantization in one launch (quant/fp8.py's CUDA path).

Each program takes one token's row: a first pass over the row finds its amax, a second writes x / scale as e4m3
(round to nearest even, saturating at ±448) and the float32 scale amax / 448 (1 for an all-zero row). The torch
ops it replaces (abs, amax, where, float, divide, clamp, cast: about eight launches and as many passes over the
row) cost more than the FP8 GEMM itself at decode's few tokens; the numbers are the same, bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_FP8_MAX = tl.constexpr(FP8_MAX)  # the kernels' copy: a jit kernel's global must be a constexpr


@triton.jit
def _quantize_rows_kernel(x_ptr, stride_x, q_ptr, stride_q, scale_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=start + offs < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_max = tl.max(amax, axis=0)
    scale = tl.where(row_max > 0, row_max / _FP8_MAX, 1.0)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=start + offs < cols, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + row * stride_q + start + offs, q.to(q_ptr.dtype.element_ty), mask=start + offs < cols)


def quantize_rows_fp8(x: torch.Tensor, block: int = 1024,
                      out_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (fp32/bf16/fp16, unit stride along K) → (e4m3 [M, K], float32 scale [M, 1]), each row's amax mapped
    to 448: quant/fp8.quantize_activation_fp8's numbers.

    block: columns per pass of a program, a power of two. out_dtype float32 stores the clamped x / scale before the
    e4m3 cast (the tests' view under TRITON_INTERPRET, whose float8 conversion does not round as the GPU does)."""
    assert x.dim() == 2 and x.stride(1) == 1 and block & (block - 1) == 0
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, x.stride(0), q, q.stride(0), scale, cols, BLOCK=block, num_warps=4)
    return q, scale
