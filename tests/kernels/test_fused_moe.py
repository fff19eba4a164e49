"""The fused MoE (kernels/fused_moe.py): the expert alignment's layout, the grouped GEMM against each expert's torch
matmul, and the whole layer (router, kernels, combine) against moe.py's torch path and the fp32 reference.

Tolerances: fp32 inputs are held to 1e-5 relative error. bf16 runs on the GPU only (the interpreter's tl.dot on
bf16 operands returns garbage, so the CPU tests are fp32) and is held to 2e-2: the fused path rounds once per GEMM
(gate and up kept in fp32 through SiLU) where the torch path rounds after each op, so the two differ by a few bf16
ulps (2⁻⁸ relative) per element, and a wrong row or expert is off by O(1)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker.kernels import fused_moe as fm
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.moe import SparseMoe
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err

TILE = fm.MoeTile(16, 16, 16)  # tl.dot's smallest tile; the shapes below leave N and K tiles partly filled


def _weights(num_experts: int, hidden: int, inter: int, gen: torch.Generator, dtype: torch.dtype):
    gate_up = randn((num_experts, 2 * inter, hidden), gen, dtype, DEVICE, scale=hidden ** -0.5)  # [E, 2I, H]
    down = randn((num_experts, hidden, inter), gen, dtype, DEVICE, scale=inter ** -0.5)  # [E, H, I]
    return gate_up, down


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, hit: int | None = None):
    """top_ids [T, k] distinct per token, drawn from the first `hit` experts (the rest get no tokens); weights fp32."""
    hit = hit or num_experts
    ids = torch.stack([torch.randperm(hit, generator=gen)[:top_k] for _ in range(num_tokens)])
    return ids.to(DEVICE), torch.rand((num_tokens, top_k), generator=gen).to(DEVICE)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,hit", [
    (1, 8, 2, 16, None), (9, 6, 3, 4, None), (40, 8, 2, 16, 3), (5, 4, 4, 2, None), (12, 5, 1, 8, 1)])
def test_align_places_each_pair_once_in_its_experts_blocks(num_tokens, num_experts, top_k, block_m, hit):
    gen = torch.Generator().manual_seed(num_tokens + block_m)
    ids, _ = _routing(num_tokens, num_experts, top_k, gen, hit)
    blocks = fm.align_by_expert(ids, num_experts, block_m)
    flat, num_pairs = ids.flatten().cpu(), num_tokens * top_k
    pairs, block_expert = blocks.pair_ids.cpu().long(), blocks.block_expert.cpu().long()
    # fixed sizes: the bound on the padded total, whatever the routing
    bound = fm.max_padded_pairs(num_pairs, num_experts, block_m)
    assert bound <= num_pairs + min(num_experts, num_pairs) * (block_m - 1) + block_m - 1
    assert pairs.shape == (bound,) and block_expert.shape == (bound // block_m,)
    real = pairs < num_pairs
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))  # every pair exactly once
    assert ((pairs[~real] == num_pairs)).all()
    row_expert = block_expert.repeat_interleave(block_m)  # [bound]
    assert (row_expert[real] == flat[pairs[real]]).all()  # each pair in a block of its own expert
    counts = torch.bincount(flat, minlength=num_experts)
    used = -(-counts // block_m)  # blocks per expert: only the experts hit have any
    assert block_expert.tolist() == [e for e in range(num_experts) for _ in range(used[e])] + \
        [num_experts] * (len(block_expert) - int(used.sum()))
    for e in range(num_experts):  # an expert's pairs first, in pair (so token) order, then < block_m of padding
        rows = pairs[row_expert == e]
        assert rows[:counts[e]].tolist() == (flat == e).nonzero().flatten().tolist()
        assert (rows[counts[e]:] == num_pairs).all() and len(rows) - counts[e] < block_m


@pytest.mark.parametrize("route", [False, True])
def test_grouped_gemm_matches_each_experts_matmul(route):
    num_tokens, num_experts, top_k, hidden, inter = 11, 5, 2, 40, 24
    gen = torch.Generator().manual_seed(3)
    gate_up, down = _weights(num_experts, hidden, inter, gen, torch.float32)
    x = randn((num_tokens, hidden), gen, torch.float32, DEVICE)
    ids, weights = _routing(num_tokens, num_experts, top_k, gen, hit=4)  # expert 4 gets no tokens
    blocks = fm.align_by_expert(ids, num_experts, TILE.block_m)
    num_pairs = num_tokens * top_k
    act = fm.moe_gemm(x, gate_up, blocks, num_pairs, top_k, silu_mul=True, tile=TILE)  # [T·k, I]
    route_weights = weights.flatten().contiguous() if route else None
    out = fm.moe_gemm(act, down, blocks, num_pairs, 1, silu_mul=False, route_weights=route_weights, tile=TILE)
    for p, e in enumerate(ids.flatten().tolist()):
        gate, up = F.linear(x[p // top_k], gate_up[e]).chunk(2)
        want_act = F.silu(gate) * up
        want = F.linear(act[p], down[e]) * (weights.flatten()[p] if route else 1.0)
        assert rel_err(act[p], want_act) < 1e-5 and rel_err(out[p], want) < 1e-5, (p, e)


def _sparse_moe(num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> SparseMoe:
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=8, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=hidden, num_experts=num_experts,
                      num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=True)
    torch.manual_seed(seed)
    moe = SparseMoe(cfg)
    torch.nn.init.normal_(moe.experts.gate_up_proj, std=hidden ** -0.5)
    torch.nn.init.normal_(moe.experts.down_proj, std=inter ** -0.5)
    return moe.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (1, 8, 1), (7, 6, 2), (20, 8, 3), (33, 3, 3)])
def test_the_layer_on_the_kernels_matches_the_torch_path(num_tokens, num_experts, top_k):
    """SparseMoe with the fused experts (use_fused, as on CUDA) against its torch path and the fp32 reference; T = 1
    and few tokens over many experts leave experts with no tokens."""
    moe = _sparse_moe(num_experts, top_k, 40, 24, torch.float32, seed=num_tokens + num_experts)
    x = torch.randn(num_tokens, 40).to(DEVICE)
    with torch.no_grad():
        moe.experts.use_fused = False
        torch_path = moe(x)
        moe.experts.use_fused = True
        fused = moe(x)
        ids, weights = moe.route(x)
        ref = fm.fused_moe_ref(x, moe.experts.gate_up_proj, moe.experts.down_proj, ids, weights)
    assert fused.shape == x.shape and fused.dtype == x.dtype
    assert rel_err(fused, torch_path) < 1e-5 and rel_err(fused, ref) < 1e-5


@pytest.mark.gpu
@gpu_only
def test_bf16_within_a_few_ulps_and_a_wrong_expert_is_not():
    moe = _sparse_moe(6, 2, 32, 16, torch.bfloat16, seed=5)
    x = torch.randn(9, 32).to(device=DEVICE, dtype=torch.bfloat16)
    experts = moe.experts
    with torch.no_grad():
        ids, weights = moe.route(x)
        fused = fm.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, weights, tile=TILE)
        ref = fm.fused_moe_ref(x, experts.gate_up_proj, experts.down_proj, ids, weights)
        shifted = fm.fused_moe(x, experts.gate_up_proj, experts.down_proj, (ids + 1) % 6, weights, tile=TILE)
    assert fused.dtype == torch.bfloat16
    assert rel_err(fused, ref) < 2e-2
    assert rel_err(shifted, ref) > 0.3


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_captured_in_a_cuda_graph_on_qwen3_30b_a3b_shapes(num_tokens):
    """The whole path in one CUDA graph (a host sync would fail the capture), replayed on a new routing."""
    gen = torch.Generator().manual_seed(num_tokens)
    gate_up, down = _weights(128, 2048, 768, gen, torch.bfloat16)
    x = randn((num_tokens, 2048), gen, torch.bfloat16, DEVICE)
    ids, weights = _routing(num_tokens, 128, 8, gen)
    out = fm.fused_moe(x, gate_up, down, ids, weights)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, gate_up, down, ids, weights)
    new_ids, new_weights = _routing(num_tokens, 128, 8, gen, hit=16)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    assert rel_err(out, fm.fused_moe_ref(x, gate_up, down, ids, weights)) < 2e-2
