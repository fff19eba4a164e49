"""GPU timing shared by the benchmarks: a call's median GPU time, a call captured as a CUDA graph, and the copy
bandwidth that every figure is held against."""
from __future__ import annotations

from typing import Callable

import torch


def time_gpu(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> float:
    """Median seconds of fn on the GPU (triton.testing.do_bench: L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn run once (compiling its kernels), then captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def copy_bandwidth() -> float:
    """TB/s of a 1 GiB device-to-device copy (read + write), median under do_bench."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / time_gpu(lambda: dst.copy_(src)) / 1e12
