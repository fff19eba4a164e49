"""The mixture-of-experts router in one Triton launch: router logits [T, E] → the top k experts of each token's
softmax, renormalised to sum 1 when asked; one program per token instead of torch's softmax, topk and division
(3-5 launches). With fused_moe.align_small it takes ~15 launches of tiny kernels out of each MoE layer of a decode
step (at batch 1 a Qwen3-30B-A3B layer routes 8 pairs). Fixed output sizes, no host sync."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program's warps. Its 2·TOP_K reductions over E logits run one after another; in one warp each is register
# shuffles only, in several each also crosses warps through shared memory behind a barrier.
ROUTE_WARPS = 4


@triton.jit
def _route_topk_kernel(logits_ptr, ids_ptr, weights_ptr, stride_l, num_experts, TOP_K: tl.constexpr,
                       NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # the softmax over all experts, fp32
    p = tl.where(mask, p, -1.0)
    k_offs = tl.arange(0, TOP_K)
    ids = tl.zeros([TOP_K], dtype=tl.int64)
    weights = tl.zeros([TOP_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # the largest left, then masked out: descending, as torch.topk
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest index among equals
        ids = tl.where(k_offs == j, idx.to(tl.int64), ids)
        weights = tl.where(k_offs == j, best, weights)
        p = tl.where(offs == idx, -1.0, p)
    if NORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(ids_ptr + t * TOP_K + k_offs, ids)
    tl.store(weights_ptr + t * TOP_K + k_offs, weights)


def route_topk(logits: torch.Tensor, top_k: int, normalize: bool,
               num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (top_ids [T, k] int64, top_weights [T, k] fp32): softmax in fp32, the k largest in
    descending order, divided by their sum when normalize. top_k must be a power of two (8 in Qwen3-MoE, 2 in
    Mixtral). num_warps: a program's warps (default ROUTE_WARPS; bench/kernel_table.py times the others)."""
    num_tokens, num_experts = logits.shape
    assert top_k & (top_k - 1) == 0 and logits.stride(1) == 1
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](logits, ids, weights, logits.stride(0), num_experts, TOP_K=top_k,
                                          NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                          num_warps=num_warps or ROUTE_WARPS)
    return ids, weights


def route_topk_ref(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.SparseMoe's torch router, on given logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True) if normalize else weights
