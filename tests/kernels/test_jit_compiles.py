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


@pytest.mark.gpu
@gpu_only
def test_mixed_steps_of_new_sizes_compile_nothing_after_the_first_workload():
    """After graph capture and one workload of mixed steps, another with other prompt lengths (other counts of leading
    decodes, page-table widths across 16 pages) runs on the kernels already compiled (tests/kernels/
    test_specialization.py checks the same on the CPU, key by key)."""
    from triton import knobs

    from bench.gpu_suite import JitCompiles
    from services.gpu_worker.engine import Engine
    from services.gpu_worker.engine_config import EngineConfig
    from services.gpu_worker.model.loader import load_model
    from services.gpu_worker.request import SamplingParams

    loaded = load_model("random:qwen3-0.6b", dtype=torch.bfloat16, device="cuda", seed=3)
    config = EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16", num_pages=1024,
                          max_num_seqs=8, max_num_batched_tokens=64)
    engine = Engine(config, loaded=loaded)
    vocab = loaded.config.vocab_size

    def run(lengths: tuple[int, ...], max_tokens: int) -> None:
        prompts = [[(i * 37 + j * 11) % vocab for j in range(n)] for i, n in enumerate(lengths)]
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    try:
        jit = JitCompiles()
        run((5, 40, 77, 130, 200, 260), 20)
        first = jit.take()
        run((17, 63, 99, 150, 230, 290, 11, 333, 45), 24)
        second = jit.take()
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    assert engine.graphs.num_replays > 0
    assert second == {"kernels": {}, "seconds": 0.0}, (first, second)
