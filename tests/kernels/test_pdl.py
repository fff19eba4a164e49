"""Programmatic dependent launch (kernels/pdl.py): when it is on, how it is chosen, and that it changes no bit.

On the GPU each decode-path kernel runs right after a cuBLAS GEMM (or another PDL kernel) writing its input,
inside a CUDA graph, the way a decode step runs it; with PDL the kernel may start before that GEMM finishes, so
a missing wait would read stale memory. The outputs must equal PDL-off's exactly, and the engine's tokens too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.kernels import pdl
from services.gpu_worker.model.loader import load_model
from tests.kernels.helpers import assert_switch_keeps_every_bit, gpu_only, random_paged_cache, randn

needs_pdl = pytest.mark.skipif(not (torch.cuda.is_available() and pdl.supported("cuda")),
                               reason="needs a CUDA device of compute capability >= 9.0")


@pytest.fixture(autouse=True)
def _restore_switch():
    before = pdl.is_enabled()
    yield
    pdl.set_enabled(before)


def test_auto_is_off_on_the_cpu_and_on_is_refused_there():
    assert pdl.resolve("auto", "cpu") is False
    assert pdl.resolve("off", "cpu") is False
    with pytest.raises(ValueError, match="compute capability"):
        pdl.resolve("on", "cpu")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        pdl.resolve("yes", "cpu")


def test_engine_config_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="pdl must be"):
        EngineConfig(pdl="always")


def test_launch_options_follow_the_switch():
    pdl.set_enabled(True)
    assert pdl.launch_options() == {"USE_PDL": pdl.ON_LEVEL, "launch_pdl": True}
    pdl.set_enabled(True, level=1)
    assert pdl.launch_options() == {"USE_PDL": 1, "launch_pdl": True}
    pdl.set_enabled(False, level=2)
    assert pdl.launch_options() == {"USE_PDL": 0} and not pdl.is_enabled()
    with pytest.raises(ValueError):
        pdl.set_enabled(True, level=3)


def test_triton_engine_on_the_cpu_turns_it_off():
    """The interpreter has no grid dependency control: an engine on the CPU leaves every launch without it."""
    if torch.cuda.is_available():
        pytest.skip("CPU case")
    pdl.set_enabled(True)
    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=64,
                          attention_backend="triton", pdl="auto")
    Engine(config, loaded=load_model("random:tiny-llama", dtype=torch.float32, seed=1))
    assert not pdl.is_enabled()


def _graph_outputs(fn, level: int):
    """fn's outputs replayed from a CUDA graph captured at a PDL level (0: off)."""
    pdl.set_enabled(level > 0, level=level)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.gpu
@needs_pdl
def test_each_decode_kernel_after_a_gemm_gives_the_same_bits():
    from services.gpu_worker.kernels.argmax import argmax_rows
    from services.gpu_worker.kernels.decode_attention import decode_attention_rope
    from services.gpu_worker.kernels.embedding import embedding_fed
    from services.gpu_worker.kernels.rms_norm import rms_norm
    from services.gpu_worker.kernels.silu_mul import silu_mul

    gen = torch.Generator().manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    a = randn((3, 4096), gen, bf16, dev)
    w_big = randn((8192, 4096), gen, bf16, dev, scale=0.02)  # a GEMM long enough to still run at the launch
    w_norm = randn((4096,), gen, bf16, dev, scale=0.1) + 1
    res = randn((3, 4096), gen, bf16, dev)
    seq_lens = [700, 33, 1500]
    k_cache, v_cache, table, lens = random_paged_cache(seq_lens, 16, 8, 128, bf16, dev, gen)
    positions = (lens - 1).to(torch.int32)
    slots = (table[torch.arange(3, device=dev), (positions // 16).long()].long() * 16 + positions % 16).to(torch.int32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=dev, dtype=torch.float32) / 128))
    emb = randn((1000, 4096), gen, bf16, dev)
    ids = torch.tensor([5, 6, 7], device=dev)
    src = torch.tensor([1, -1, 0], device=dev)
    w_head = randn((1000, 8192), gen, bf16, dev, scale=0.02)

    def chain():
        caches = (k_cache.clone(), v_cache.clone())  # NOTE: the attention writes the new k/v into them
        h = F.linear(a, w_big)  # [3, 8192]
        normed, res_out = rms_norm(h[:, :4096], w_norm, 1e-5, res)
        act = silu_mul(F.linear(normed, w_big))  # [3, 4096]
        qkv = F.linear(act, w_big[:6144]).view(3, 48, 128)
        out = decode_attention_rope(qkv[:, :32], qkv[:, 32:40], qkv[:, 40:], positions, inv_freq, *caches, slots,
                                    table, lens, 16)
        parts = torch.stack([F.linear(out.reshape(3, -1), w_big[:4096, :4096]).float()] * 4)
        normed2, _ = rms_norm(parts, w_norm, 1e-5, res_out)
        tokens = argmax_rows(F.linear(F.linear(normed2, w_big), w_head).float())
        fed = embedding_fed(emb, ids, src, tokens)
        return [normed, res_out, act, out, normed2, tokens, fed, *caches]

    with torch.inference_mode():
        off = _graph_outputs(chain, 0)
        for level in (1, 2):
            on = _graph_outputs(chain, level)
            for i, (x, y) in enumerate(zip(off, on)):
                assert torch.equal(x, y), f"output {i} differs with PDL level {level}"


@pytest.mark.gpu
@gpu_only
@needs_pdl
def test_engine_gives_the_same_tokens_and_logprobs_with_and_without_pdl():
    """Graph steps of several batch sizes and eager mixed steps: PDL on and off give the very same bits."""
    loaded = load_model("random:qwen3-0.6b", dtype=torch.bfloat16, device="cuda", seed=3)

    def check(engine, mode):
        assert pdl.is_enabled() == (mode == "on")

    assert_switch_keeps_every_bit(loaded, "pdl", check)
