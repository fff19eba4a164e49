"""The decode steps' MoE (kernels/moe_gemv.py) against the fp32 reference, and fused_moe's choice of it: tiles that
leave N and K partly filled, tokens that share an expert, and the combine folded into the down pass.

fp32 on the CPU's interpreter is held to 1e-5 relative error; bf16 (GPU only) to 2e-2, as tests/kernels/
test_fused_moe.py says why."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels import fused_moe as fm
from services.gpu_worker.kernels.moe_gemv import GemvTile, MoeGemvConfig, default_config, moe_gemv
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _layer(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, seed: int,
           dtype: torch.dtype = torch.float32, hit: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    gate_up = randn((num_experts, 2 * inter, hidden), gen, dtype, DEVICE, scale=hidden ** -0.5)
    down = randn((num_experts, hidden, inter), gen, dtype, DEVICE, scale=inter ** -0.5)
    x = randn((num_tokens, hidden), gen, dtype, DEVICE)
    ids = torch.stack([torch.randperm(hit or num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand((num_tokens, top_k), generator=gen)
    return x, gate_up, down, ids.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,config", [
    (1, 8, 2, 64, 48, None),  # down's K (48) in one partly filled 64-column step
    (1, 128, 8, 128, 96, MoeGemvConfig(GemvTile(4, 32), GemvTile(8, 32))),  # K in several steps, exact
    (3, 6, 3, 40, 24, MoeGemvConfig(GemvTile(16, 16), GemvTile(16, 16))),  # N and K tiles partly filled
    (4, 4, 2, 32, 16, None),  # 8 pairs over 2 experts: tokens share them
    (2, 5, 1, 24, 40, MoeGemvConfig(GemvTile(1, 8), GemvTile(2, 8))),  # top-1
    (3, 6, 3, 40, 24, MoeGemvConfig(GemvTile(16, 16), GemvTile(2, 64))),  # k = 3: a fourth expert slot masked
])
def test_matches_the_reference(num_tokens, num_experts, top_k, hidden, inter, config):
    x, gate_up, down, ids, weights = _layer(num_tokens, num_experts, top_k, hidden, inter, seed=num_tokens + top_k,
                                            hit=2 if num_experts == 4 else None)
    got = moe_gemv(x, gate_up, down, ids, weights, config)
    want = fm.fused_moe_ref(x, gate_up, down, ids, weights)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, want) < 1e-5
    # each token's k experts and their weights count: dropping the last choice moves the answer
    if top_k > 1:
        assert rel_err(moe_gemv(x, gate_up, down, ids[:, :-1], weights[:, :-1], config), want) > 1e-2


def test_default_config_is_the_measured_tile_capped_by_the_row():
    cfg = default_config(2048, 768)
    assert cfg == MoeGemvConfig(GemvTile(4, 512, 4, 2), GemvTile(2, 128, 4, 1))
    assert default_config(40, 24) == MoeGemvConfig(GemvTile(4, 64, 4, 2), GemvTile(2, 32, 4, 1))  # small rows


@pytest.mark.parametrize("num_tokens", [1, fm.GEMV_MAX_TOKENS, fm.GEMV_MAX_TOKENS + 1])
def test_fused_moe_takes_it_up_to_gemv_max_tokens(monkeypatch, num_tokens):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return moe_gemv(*args, **kwargs)

    monkeypatch.setattr(fm, "moe_gemv", counting)
    x, gate_up, down, ids, weights = _layer(num_tokens, 8, 2, 32, 16, seed=num_tokens)
    want = fm.fused_moe_ref(x, gate_up, down, ids, weights)
    tile = fm.MoeTile(16, 16, 16)
    assert rel_err(fm.fused_moe(x, gate_up, down, ids, weights, tile=tile), want) < 1e-5
    assert calls == ([num_tokens] if num_tokens <= fm.GEMV_MAX_TOKENS else [])
    assert rel_err(fm.fused_moe(x, gate_up, down, ids, weights, tile=tile, gemv_max_tokens=0), want) < 1e-5
    assert len(calls) == (1 if num_tokens <= fm.GEMV_MAX_TOKENS else 0)  # 0: the grouped GEMM only


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_bf16_on_qwen3_30b_a3b_shapes_and_under_a_cuda_graph(num_tokens):
    x, gate_up, down, ids, weights = _layer(num_tokens, 128, 8, 2048, 768, seed=num_tokens, dtype=torch.bfloat16)
    out = moe_gemv(x, gate_up, down, ids, weights)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(x, gate_up, down, ids, weights)
    ids.copy_((ids + 1) % 128)
    graph.replay()
    want = fm.fused_moe_ref(x, gate_up, down, ids, weights)
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < 2e-2
    assert rel_err(fm.fused_moe_ref(x, gate_up, down, (ids + 1) % 128, weights), want) > 0.3
