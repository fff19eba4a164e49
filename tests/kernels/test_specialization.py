"""Each Triton kernel compiles once per configuration, not again as a step's sizes move.

Triton specializes a compiled kernel on its runtime arguments: an integer that is 1 or divides by 16, a pointer
aligned to 16 bytes. An argument that changes between steps in one of these properties costs a new compile (a
second or more on the H200) in the middle of serving: bench/gpu_suite.py's jit_compiles found 7.3 s of them in
W0's first run and 5.5 s in W1's, after a warm-up. The engine keeps them fixed (its page table's width a multiple of
16 pages) and the kernels do not specialize on the alignment of index slices they read one value of.

On the CPU the kernels run under Triton's interpreter, which compiles nothing; this test records, for every launch,
the key Triton would compile under (its constexprs and launch options, and each runtime argument's specialized
properties, honouring do_not_specialize and do_not_specialize_on_alignment) over a workload of mixed steps, and
requires one key per configuration."""
from __future__ import annotations

import collections

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams

if torch.cuda.is_available():
    pytest.skip("the interpreter's launches (CPU)", allow_module_level=True)

interpreter = pytest.importorskip("triton.runtime.interpreter")


def _runtime_key(fn, args) -> tuple:
    """What Triton specializes a launch on, argument by argument (None: not specialized)."""
    opts = fn.kwargs
    no_spec = set(opts.get("do_not_specialize") or ())
    no_align = set(opts.get("do_not_specialize_on_alignment") or ())
    key = []
    for name, a in zip(fn.arg_names, args):
        if isinstance(a, torch.Tensor):
            key.append((name, str(a.dtype), None if name in no_spec | no_align else a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or a is None:
            key.append((name, a))
        elif isinstance(a, int):
            key.append((name, None if name in no_spec else (a == 1, a % 16 == 0, a >= 2 ** 31)))
        else:
            key.append((name, type(a).__name__))
    return tuple(key)


@pytest.fixture
def launches(monkeypatch):
    """kernel name → configuration (constexprs, launch options) → the runtime keys launched under it."""
    seen: dict = collections.defaultdict(lambda: collections.defaultdict(set))
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        config = tuple(sorted((k, str(v.dtype) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()))
        seen[self.fn.__name__][config].add(_runtime_key(self, args))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    return seen


def test_mixed_steps_launch_each_kernel_configuration_under_one_specialization(launches):
    # 4-token pages: the widest sequence (58 + 12 tokens) decodes through 15, 16 and 17 pages, while the steps mix
    # decodes (1 to 5 leading ones: index slices at every offset) with prefill chunks
    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=512, page_size=4,
                          attention_backend="triton", max_num_seqs=6, max_num_batched_tokens=48)
    engine = Engine(config, loaded=load_model("random:tiny-llama", dtype=torch.float32, seed=1))
    prompts = [[(i * 31 + j) % 200 + 3 for j in range(length)] for i, length in enumerate((9, 58, 23, 41, 37, 15))]
    engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert {"_extend_kernel", "_rope_kv_write_kernel", "_decode_split_kernel"} <= set(launches)
    respecialized = {}
    for kernel, configs in launches.items():
        for cfg, keys in configs.items():
            if len(keys) > 1:
                first, *rest = sorted(keys, key=repr)
                respecialized[kernel] = sorted({a[0] for k in rest for a, b in zip(k, first) if a != b})
    assert not respecialized, f"kernels compiled again for a runtime argument's change: {respecialized}"
    # and the eager steps pass positions and slots as the CUDA graphs' int32 buffers do (cuda_graphs.py), so a mixed
    # step's decodes run the decode kernel the graphs compiled (run 29 on the H200: 1-3 s of compiles before)
    index_dtypes = {(kernel, a[0], a[1]) for kernel in ("_decode_split_kernel", "_rope_kv_write_kernel")
                    for keys in launches[kernel].values() for key in keys for a in key
                    if a[0] in ("pos_ptr", "slot_ptr")}
    assert {d for _, _, d in index_dtypes} == {"torch.int32"}, index_dtypes


def test_the_warm_up_launches_every_configuration_that_serving_then_uses(launches):
    """Engine.warm_up (on by default on CUDA) runs the kernels' configurations before the first request: a workload
    after it launches none it did not. The decode kernels are left out here: on the GPU the CUDA graphs' capture
    compiles them for every batch size (their split count and tile follow the number of sequences), and the CPU
    has no graphs."""
    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=512, page_size=4,
                          attention_backend="triton", max_num_seqs=6, max_num_batched_tokens=48, warmup=True)
    engine = Engine(config, loaded=load_model("random:tiny-llama", dtype=torch.float32, seed=1))
    assert engine.warmup_seconds > 0
    stats = engine.stats()
    assert (stats.num_steps, stats.num_cached_pages, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    assert stats.num_free_pages == stats.num_total_pages and engine.cache.drain_events() == []
    warm = {(kernel, cfg) for kernel, configs in launches.items() for cfg in configs}
    prompts = [[(i * 13 + j) % 200 + 3 for j in range(length)] for i, length in enumerate((3, 44, 90, 17, 31, 60))]
    engine.generate(prompts, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    later = {(kernel, cfg) for kernel, configs in launches.items() for cfg in configs}
    missing = sorted(k for k, _ in later - warm if k not in ("_decode_split_kernel", "_decode_reduce_kernel"))
    assert not missing, f"first launched after the warm-up: {missing}"


def test_warmup_is_off_on_the_cpu_by_default_and_refused_under_tensor_parallelism():
    assert not EngineConfig(device="cpu").resolved_warmup("triton")
    assert not EngineConfig(device="cpu", warmup=None).resolved_warmup("torch")
    assert EngineConfig(device="cpu", warmup=True).resolved_warmup("torch")
    with pytest.raises(ValueError, match="single-rank"):
        EngineConfig(warmup=True, tensor_parallel_size=2)
