"""The MoE router and small-batch expert sort (kernels/moe_routing.py) against their torch references: the same
experts in the same order, weights to fp32 rounding, and align_small's layout equal to align_by_expert's."""
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


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,hit", [
    (1, 128, 8, 16, None), (32, 128, 8, 16, None), (7, 6, 2, 16, None), (3, 8, 2, 64, None), (40, 8, 2, 16, 3),
    (64, 16, 4, 16, 4), (1, 6, 1, 16, None)])
def test_align_small_equals_align_by_expert(num_tokens, num_experts, top_k, block_m, hit):
    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    ids = torch.stack([torch.randperm(hit or num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    got = fm.align_small(ids.to(DEVICE), num_experts, block_m)
    want = fm.align_by_expert(ids.to(DEVICE), num_experts, block_m)
    assert torch.equal(got.pair_ids, want.pair_ids)
    assert torch.equal(got.block_expert, want.block_expert)


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
