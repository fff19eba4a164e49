"""bench.gpu_suite.JitCompiles: the suite's count of Triton compilations within a timed run (GPU only: on the CPU
the interpreter compiles nothing)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels.helpers import gpu_only


@triton.jit
def _add_one(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)


@pytest.mark.gpu
@gpu_only
def test_a_kernel_compiled_in_a_run_is_counted_once():
    from triton import knobs

    from bench.gpu_suite import JitCompiles

    try:
        jit = JitCompiles()
        x = torch.zeros(16, device="cuda")
        _add_one[(1,)](x, N=16)
        _add_one[(1,)](x, N=16)  # in memory now: not compiled again
        taken = jit.take()
        _add_one[(1,)](x, N=32 // 2)
        again = jit.take()
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    assert torch.equal(x, torch.full_like(x, 3.0))  # the hooks let every launch compile and run
    assert taken["kernels"] == {"_add_one": 1} and taken["seconds"] > 0
    assert again == {"kernels": {}, "seconds": 0.0}
