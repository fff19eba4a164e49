"""The mixture-of-experts router and the expert sort of small batches, each one Triton launch (decode steps).

    route_topk   router logits [T, E] → the top k experts of each token's softmax, renormalised to sum 1 when
                 asked: one program per token instead of torch's softmax, topk and division (3-5 launches).
    align_small  fused_moe.align_by_expert's result for T·k ≤ SMALL_PAIRS pairs in one program instead of about a
                 dozen torch ops: the per-expert counts, the padded offsets (a cumulative sum over E), each pair's
                 rank among the earlier pairs of its expert (a T·k × T·k comparison) and the block → expert map.

At batch 1 a Qwen3-30B-A3B layer routes 8 pairs, so its MoE's GPU time is mostly launches: these two kernels
replace ~15 of them in each of its 48 layers. Both have fixed output sizes and no host sync (CUDA graphs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels.fused_moe import ExpertBlocks, max_padded_pairs

SMALL_PAIRS = 256  # align_small's limit: its rank step compares every pair with every other one


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


def route_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (top_ids [T, k] int64, top_weights [T, k] fp32): softmax in fp32, the k largest in
    descending order, divided by their sum when normalize. top_k must be a power of two (8 in Qwen3-MoE, 2 in
    Mixtral)."""
    num_tokens, num_experts = logits.shape
    assert top_k & (top_k - 1) == 0 and logits.stride(1) == 1
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](logits, ids, weights, logits.stride(0), num_experts, TOP_K=top_k,
                                          NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(num_experts))
    return ids, weights


def route_topk_ref(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.SparseMoe's torch router, on given logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True) if normalize else weights


@triton.jit
def _align_small_kernel(ids_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, num_experts, max_padded, num_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_PAD: tl.constexpr, BLOCK_B: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    valid = p < num_pairs
    e = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    ex = tl.arange(0, BLOCK_E)
    hit = (e[None, :] == ex[:, None]) & valid[None, :]  # [E, P]
    counts = tl.sum(hit.to(tl.int32), axis=1)  # [E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    # each pair's place: its expert's first row plus the earlier pairs of the same expert (stable order)
    same_before = (e[None, :] == e[:, None]) & (p[None, :] < p[:, None]) & valid[None, :]  # [P, P]
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    start = tl.sum(tl.where(hit, padded_start[:, None], 0), axis=0)  # [P]: padded_start[e]
    rows = tl.arange(0, BLOCK_PAD)
    tl.store(pair_ids_ptr + rows, tl.full([BLOCK_PAD], 0, tl.int32) + num_pairs, mask=rows < max_padded)
    tl.debug_barrier()  # the padding written before the pairs land on it
    tl.store(pair_ids_ptr + start + rank, p, mask=valid)
    # block b's expert: the experts (of those that exist) whose padded rows end at or before the block's first row
    b = tl.arange(0, BLOCK_B)
    ended = (padded_end[None, :] <= b[:, None] * BLOCK_M) & (ex[None, :] < num_experts)  # [B, E]
    tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < num_blocks)


def align_small(top_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """fused_moe.align_by_expert in one launch, for top_ids [T, k] with T·k ≤ SMALL_PAIRS."""
    num_pairs = top_ids.numel()
    assert 0 < num_pairs <= SMALL_PAIRS
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    pair_ids = torch.empty(max_padded, dtype=torch.int32, device=top_ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=top_ids.device)
    _align_small_kernel[(1,)](top_ids.contiguous(), pair_ids, block_expert, num_pairs, num_experts, max_padded,
                              num_blocks, BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(num_pairs)),
                              BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
                              BLOCK_PAD=triton.next_power_of_2(max_padded),
                              BLOCK_B=max(16, triton.next_power_of_2(num_blocks)), num_warps=8)
    return ExpertBlocks(pair_ids, block_expert, block_m)
