"""A word copy run by the GPU's cores rather than its copy engine, for a decode graph's inputs.

The source may be pinned host memory: under unified addressing a page-locked host buffer has a device address,
and a kernel reads it over PCIe directly. Captured as a CUDA graph's first node, it lets one replay take the
step's inputs from a fixed pinned buffer with no copy-engine transfer queued before the graph (on the H200 the
GPU sat idle ~34 µs per batch-1 step between that transfer and the graph's first kernel: bench/h200_probe.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, num, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_words_(dst: torch.Tensor, src: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """dst[:] = src for two contiguous 1-D tensors of one dtype; src may be pinned host memory."""
    assert dst.shape == src.shape and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
    if dst.numel():
        _copy_kernel[(triton.cdiv(dst.numel(), block),)](src, dst, dst.numel(), BLOCK=block, num_warps=4)
    return dst
