"""The MoE router and the expert sorts (kernels/moe_routing.py, fused_moe's align_small and align_chunked) against
their torch references: the same experts in the same order, weights to fp32 rounding, and the sorts' layouts equal to
align_by_expert's."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels import fused_moe as fm
from services.gpu_worker.kernels import moe_routing as mr
from tests.kernels.helpers import DEVICE, gpu_only, randn


@pytest.mark.parametrize("num_tokens,num_experts,top_k,normalize", [
    (1, 128, 8, True), (5, 6, 2, False), (33, 128, 8, True), (3, 8, 2, True), (4, 60, 4, False)])
def test_route_topk_equals_softmax_topk(num_tokens, num_experts, top_k, normalize):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = randn((num_tokens, num_experts), gen, torch.float32, DEVICE, scale=3.0)
    ids, weights = mr.route_topk(logits, top_k, normalize)
    ref_ids, ref_weights = mr.route_topk_ref(logits, top_k, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens, device=DEVICE))


@pytest.mark.parametrize("num_tokens,hidden,num_experts,parts", [
    (1, 64, 16, 1), (3, 48, 7, 1), (4, 64, 128, 1), (2, 48, 6, 3)])
def test_norm_router_equals_rms_norm_then_the_router(num_tokens, hidden, num_experts, parts):
    """The fused residual add, RMSNorm and router logits: the normed activation and the residual bit for bit as
    rms_norm writes them (hidden 48: a masked block; 7 experts: a half-filled last program; 3 split-K partials
    summed first), the logits as the router's matmul of that activation."""
    from services.gpu_worker.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(num_tokens + hidden)
    h = randn((parts, num_tokens, hidden) if parts > 1 else (num_tokens, hidden), gen, torch.float32, DEVICE)
    residual = randn((num_tokens, hidden), gen, torch.float32, DEVICE)
    norm_weight = randn((hidden,), gen, torch.float32, DEVICE) + 1.0
    router = randn((num_experts, hidden), gen, torch.float32, DEVICE, scale=hidden ** -0.5)
    x, res_out, logits = mr.norm_router(h, residual, norm_weight, 1e-6, router)
    want_x, want_res = rms_norm(h, norm_weight, 1e-6, residual)
    assert torch.equal(x, want_x) and torch.equal(res_out, want_res)
    assert logits.shape == (num_tokens, num_experts)
    torch.testing.assert_close(logits, want_x @ router.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("align,num_tokens,num_experts,top_k,block_m,hit", [
    *(("small", *case) for case in [(1, 128, 8, 16, None), (32, 128, 8, 16, None), (7, 6, 2, 16, None),
                                    (3, 8, 2, 64, None), (40, 8, 2, 16, 3), (64, 16, 4, 16, 4), (1, 6, 1, 16, None)]),
    ("chunked", 33, 128, 8, 16, None),  # 264 pairs: two chunks, the second nearly empty
    ("chunked", 64, 128, 8, 16, None),  # 512: two full chunks
    ("chunked", 300, 16, 4, 16, 4),  # 1,200 pairs over 4 of 16 experts: long runs that cross chunks
    ("chunked", 129, 6, 2, 64, None), ("chunked", 257, 8, 1, 16, None),
    ("chunked", 600, 128, 8, 64, 24)])  # 4,800 pairs: 19 chunks
def test_the_kernel_sorts_equal_align_by_expert(align, num_tokens, num_experts, top_k, block_m, hit):
    """align_small and align_chunked: each expert's pairs in pair order (across chunk boundaries), the padding and
    the block map as the torch sort's."""
    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    ids = torch.stack([torch.randperm(hit or num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    got = getattr(fm, f"align_{align}")(ids.to(DEVICE), num_experts, block_m)
    want = fm.align_by_expert(ids.to(DEVICE), num_experts, block_m)
    assert torch.equal(got.pair_ids, want.pair_ids)
    assert torch.equal(got.block_expert, want.block_expert)


def test_fused_moe_sorts_many_pairs_by_chunks(monkeypatch):
    """Past SMALL_PAIRS the layer sorts with align_chunked (not the torch ops), and its result equals the torch
    sort's path and the reference."""
    calls = []
    chunked = fm.align_chunked
    monkeypatch.setattr(fm, "align_chunked", lambda *a: calls.append(a[0].numel()) or chunked(*a))
    gen = torch.Generator().manual_seed(9)
    num_tokens, num_experts, top_k, hidden, inter = 70, 8, 4, 32, 16  # 280 pairs
    gate_up = randn((num_experts, 2 * inter, hidden), gen, torch.float32, DEVICE, scale=hidden ** -0.5)
    down = randn((num_experts, hidden, inter), gen, torch.float32, DEVICE, scale=inter ** -0.5)
    x = randn((num_tokens, hidden), gen, torch.float32, DEVICE)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    weights = torch.rand((num_tokens, top_k), generator=gen).to(DEVICE)
    tile = fm.MoeTile(16, 16, 16)
    got = fm.fused_moe(x, gate_up, down, ids, weights, tile=tile)
    assert calls == [num_tokens * top_k]
    via_torch = fm.fused_moe(x, gate_up, down, ids, weights, tile=tile, torch_align=True)
    assert calls == [num_tokens * top_k]  # the torch sort took the second call
    assert torch.equal(got, via_torch)
    ref = fm.fused_moe_ref(x, gate_up, down, ids, weights)
    assert float((got - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.gpu
@gpu_only
def test_both_captured_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(1)
    logits = randn((4, 128), gen, torch.bfloat16, DEVICE)
    ids, weights = mr.route_topk(logits, 8, True)
    blocks = fm.align_small(ids, 128, 16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = mr.route_topk(logits, 8, True)
        blocks = fm.align_small(ids, 128, 16)
    logits.copy_(randn((4, 128), gen, torch.bfloat16, DEVICE))
    graph.replay()
    ref_ids, ref_weights = mr.route_topk_ref(logits, 8, True)
    # bf16 logits tie (equal probabilities): the kernel takes the lower index first, torch.topk either; the same set
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(weights.sort(-1).values, ref_weights.sort(-1).values, rtol=1e-5, atol=1e-7)
    want = fm.align_by_expert(ids, 128, 16)
    assert torch.equal(blocks.pair_ids, want.pair_ids) and torch.equal(blocks.block_expert, want.block_expert)


@pytest.mark.gpu
@gpu_only
def test_norm_router_in_bf16_under_a_cuda_graph():
    """Qwen3-30B-A3B's shapes (hidden 2048, 128 experts) in bf16, replayed: the normed activation and residual bit
    for bit as rms_norm's, the logits to bf16 rounding of the router's matmul."""
    from services.gpu_worker.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(2)
    h, residual = (randn((1, 2048), gen, torch.bfloat16, DEVICE) for _ in range(2))
    norm_weight = randn((2048,), gen, torch.bfloat16, DEVICE) + 1.0
    router = randn((128, 2048), gen, torch.bfloat16, DEVICE, scale=2048 ** -0.5)
    mr.norm_router(h, residual, norm_weight, 1e-6, router)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, res_out, logits = mr.norm_router(h, residual, norm_weight, 1e-6, router)
    h.copy_(randn((1, 2048), gen, torch.bfloat16, DEVICE))
    graph.replay()
    want_x, want_res = rms_norm(h, norm_weight, 1e-6, residual)
    assert torch.equal(x, want_x) and torch.equal(res_out, want_res)
    torch.testing.assert_close(logits.float(), want_x.float() @ router.float().t(), rtol=2e-2, atol=2e-2)
