"""The mixture-of-experts MLP on the GPU: tokens sorted by expert, a grouped GEMM over the experts that were hit, and
the top-k combine, with no host sync (so it runs under CUDA graph capture).

    align_by_expert   the T·k (token, choice) pairs, pair p = t·k + j, sorted by expert and padded per expert to
                      a multiple of BLOCK_M: `pair_ids` [max_padded] (padding holds T·k) and `block_expert`
                      [max_padded / BLOCK_M] (num_experts past the last expert's blocks). Torch ops of fixed output
                      sizes: max_padded = T·k + min(E, T·k)·(BLOCK_M − 1), rounded up to BLOCK_M.
    _moe_gemm_kernel  one program per (BLOCK_M sorted pairs of one expert, BLOCK_N output columns): the gathered
                      input rows times that expert's weight tile, fp32 accumulation. The gate_up pass keeps gate
                      and up tiles side by side and writes silu(gate)·up [T·k, I]; the down pass multiplies by the
                      routing weight in its epilogue and writes [T·k, H]. Padding rows are neither read nor written;
                      blocks past the last expert's return at once.
    combine           [T·k, H] viewed as [T, k, H], summed over k (no atomics).

    moe_gemv          decode steps of at most GEMV_MAX_TOKENS tokens skip all of the above: kernels/moe_gemv.py runs
                      each pair as a matrix-vector product and folds the combine into the down pass (two launches).

    align_chunked     align_by_expert's result for more pairs (batched decode, prefill) in three launches instead of
                      a dozen torch ops around a radix sort: each chunk of CHUNK pairs counts its experts; one
                      program turns the chunks' counts into each chunk's first row per expert (the expert's padded
                      start plus the earlier chunks' counts), fills the padding and maps blocks to experts; each
                      chunk then places its pairs (rank within the chunk by a CHUNK × CHUNK comparison).

    align_small       align_by_expert's result for T·k ≤ SMALL_PAIRS (decode steps) in one program instead of
                      about a dozen torch ops: the per-expert counts, the padded offsets (a cumulative sum over E),
                      each pair's rank among the earlier pairs of its expert (a T·k × T·k comparison) and the
                      block → expert map.

Weights in moe.py's layout: gate_up [E, 2I, H] (gate rows first), down [E, H, I].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.gpu_worker.kernels.moe_gemv import moe_gemv


SMALL_PAIRS = 256  # align_small's limit: its rank step compares every pair with every other one
# Steps of at most this many tokens take kernels/moe_gemv.py (a pair's expert weights read once per pair) instead of
# the sort and the grouped GEMM (each expert hit read once). On an H100, Qwen3-30B-A3B (kernel_table --moe-gemv-sweep,
# 2026-12-07), µs a layer, GEMV against the grouped GEMM's best tile: 1 token 38.0 / 38.5, 2: 62.6 / 68.7, 4:
# 113.4 / 115.4, 8: 203.4 / 177.7, 16: 387.7 / 279.3.
GEMV_MAX_TOKENS = 4


class ExpertBlocks(NamedTuple):
    """align_by_expert's result; block_m rows of pair_ids per entry of block_expert."""
    pair_ids: torch.Tensor  # [max_padded] int32: a pair index t·k + j, or T·k for padding
    block_expert: torch.Tensor  # [max_padded / block_m] int32: the block's expert, num_experts past the last
    block_m: int


class MoeTile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2


def default_tile(num_pairs: int) -> MoeTile:
    """Measured on an H100 for Qwen3-30B-A3B (bench/kernel_table.py --moe, 2026-12-07; µs a layer, align and combine
    included). Up to 1,024 pairs (128 tokens) 16-row blocks, 16 x 64 x 128 in three stages: at 1 / 8 / 16 / 32 / 64
    / 128 tokens 38.5 / 177.7 / 279.3 / 375.3 / 484.5 / 497.7, where 16 x 64 x 64 in two took 54.3 / 191.5 / 312.6 /
    390.8 / 505.9 / 516.1. At 512 tokens 64 x 64 x 64 in three (530.0; 128 x 128 x 64 560.2); from 16,384 pairs
    (2,048 tokens: prefill chunks) 128 x 128 x 64 with 8 warps in three (818.7 against 881.3)."""
    if num_pairs <= 1024:
        return MoeTile(16, 64, 128, num_stages=3)
    if num_pairs < 16384:
        return MoeTile(64, 64, 64, num_stages=3)
    return MoeTile(128, 128, 64, num_warps=8, num_stages=3)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows align_by_expert can fill: each expert hit (at most min(E, T·k)) pads fewer than block_m rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_by_expert(top_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """top_ids [T, k] → the pairs sorted by expert (stable: token order within an expert), each expert's run padded
    to a multiple of block_m. Fixed output sizes and no host sync."""
    flat = top_ids.flatten().long()  # [P]: pair p is token p // k's choice p % k
    num_pairs, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P]
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_experts]  # place within its expert
    dest = (padded_end - padded)[sorted_experts] + rank  # [P]
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev).scatter_(0, dest, order.int())
    block_starts = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).int()  # experts ending at or before it
    return ExpertBlocks(pair_ids, block_expert, block_m)


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


ALIGN_CHUNK = 256  # pairs a program of align_chunked counts and places (its rank step compares them pairwise)
ALIGN_MAX_CHUNKS = 1024  # align_chunked's offsets program holds every chunk's counts: [chunks, E]


@triton.jit
def _chunk_count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    valid = p < num_pairs
    e = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    ex = tl.arange(0, BLOCK_E)
    hit = (e[None, :] == ex[:, None]) & valid[None, :]  # [E, CHUNK]
    tl.store(counts_ptr + c * BLOCK_E + ex, tl.sum(hit.to(tl.int32), axis=1))


@triton.jit
def _chunk_offsets_kernel(counts_ptr, base_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, num_experts, num_chunks,
                          max_padded, num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_C: tl.constexpr, STEP: tl.constexpr):
    ex = tl.arange(0, BLOCK_E)
    ch = tl.arange(0, BLOCK_C)
    in_range = ch[:, None] < num_chunks
    chunk_counts = tl.load(counts_ptr + ch[:, None] * BLOCK_E + ex[None, :], mask=in_range, other=0)  # [C, E]
    counts = tl.sum(chunk_counts, axis=0)  # [E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    earlier = tl.cumsum(chunk_counts, 0) - chunk_counts  # [C, E]: the expert's pairs in earlier chunks
    tl.store(base_ptr + ch[:, None] * BLOCK_E + ex[None, :], padded_start[None, :] + earlier, mask=in_range)
    for r0 in range(0, max_padded, STEP):  # padding everywhere; the place launch writes the pairs over it
        rows = r0 + tl.arange(0, STEP)
        tl.store(pair_ids_ptr + rows, tl.full([STEP], 0, tl.int32) + num_pairs, mask=rows < max_padded)
    for b0 in range(0, num_blocks, STEP):  # block b's expert: the experts whose padded rows end at or before it
        b = b0 + tl.arange(0, STEP)
        ended = (padded_end[None, :] <= b[:, None] * BLOCK_M) & (ex[None, :] < num_experts)  # [STEP, E]
        tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < num_blocks)


@triton.jit
def _chunk_place_kernel(ids_ptr, base_ptr, pair_ids_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    p = c * CHUNK + local
    valid = p < num_pairs
    e = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    same_before = (e[None, :] == e[:, None]) & (local[None, :] < local[:, None]) & valid[None, :]  # [CHUNK, CHUNK]
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    base = tl.load(base_ptr + c * BLOCK_E + e, mask=valid, other=0)
    tl.store(pair_ids_ptr + base + rank, p, mask=valid)


def align_chunked(top_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """fused_moe.align_by_expert in three launches, for top_ids [T, k] with T·k ≤ ALIGN_CHUNK · ALIGN_MAX_CHUNKS.
    Fixed sizes and no host sync, as align_by_expert."""
    num_pairs = top_ids.numel()
    num_chunks = triton.cdiv(num_pairs, ALIGN_CHUNK)
    assert 0 < num_chunks <= ALIGN_MAX_CHUNKS
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    block_e = max(16, triton.next_power_of_2(num_experts))
    dev = top_ids.device
    ids = top_ids.contiguous()
    counts = torch.empty((num_chunks, block_e), dtype=torch.int32, device=dev)
    base = torch.empty((num_chunks, block_e), dtype=torch.int32, device=dev)
    pair_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    _chunk_count_kernel[(num_chunks,)](ids, counts, num_pairs, CHUNK=ALIGN_CHUNK, BLOCK_E=block_e, num_warps=8)
    _chunk_offsets_kernel[(1,)](counts, base, pair_ids, block_expert, num_pairs, num_experts, num_chunks,
                                max_padded, num_blocks, BLOCK_M=block_m, BLOCK_E=block_e,
                                BLOCK_C=max(16, triton.next_power_of_2(num_chunks)), STEP=256, num_warps=8)
    _chunk_place_kernel[(num_chunks,)](ids, base, pair_ids, num_pairs, CHUNK=ALIGN_CHUNK, BLOCK_E=block_e,
                                       num_warps=8)
    return ExpertBlocks(pair_ids, block_expert, block_m)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, route_w_ptr, num_pairs, num_experts,
                     N, K, stride_am, stride_we, stride_wn, stride_om, ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr,
                     ROUTE_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:  # past the last expert's blocks
        return
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    mask_m = pairs < num_pairs  # padding rows hold num_pairs
    rows = (pairs // ROW_DIV).to(tl.int64)  # the input row: the token (gate_up) or the pair (down)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc)
        if SILU_MUL:  # the up rows sit N rows below the gate rows
            w_up = tl.load(w_base + (N + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up)
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if ROUTE_WEIGHT:
        acc *= tl.load(route_w_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def moe_gemm(a: torch.Tensor, weight: torch.Tensor, blocks: ExpertBlocks, num_pairs: int, row_div: int,
             silu_mul: bool, route_weights: torch.Tensor | None = None, tile: MoeTile | None = None) -> torch.Tensor:
    """Row p of the result (p < num_pairs) is a[p // row_div] through the weight of p's expert: weight [E, N', K].
    silu_mul: N' = 2N (gate then up), out [num_pairs, N] = silu(a·gateᵀ)·(a·upᵀ); else out [num_pairs, N'] =
    a·wᵀ, times route_weights[p] ([num_pairs] fp32) when given."""
    num_experts, rows_out, k = weight.shape
    n = rows_out // 2 if silu_mul else rows_out
    assert a.shape[1] == k and a.stride(1) == 1 and weight.stride(2) == 1
    tile = tile or default_tile(num_pairs)
    assert tile.block_m == blocks.block_m
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (blocks.block_expert.numel(), triton.cdiv(n, tile.block_n))
    _moe_gemm_kernel[grid](
        a, weight, out, blocks.pair_ids, blocks.block_expert, route_weights if route_weights is not None else a,
        num_pairs, num_experts, n, k, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        ROW_DIV=row_div, SILU_MUL=silu_mul, ROUTE_WEIGHT=route_weights is not None, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_ids: torch.Tensor,
              top_weights: torch.Tensor, tile: MoeTile | None = None,
              gemv_max_tokens: int | None = None, torch_align: bool = False) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; top_ids [T, k]; top_weights [T, k] fp32 →
    Σ_j top_weights[t, j] · down_e · (silu(gate_e · x_t) · up_e · x_t), e = top_ids[t, j]: [T, H] in x's dtype.
    Up to gemv_max_tokens tokens (None: GEMV_MAX_TOKENS; 0: never) on kernels/moe_gemv.py, else the grouped GEMM
    with `tile`, its pairs sorted by align_small or align_chunked (torch_align: by align_by_expert's torch ops, the
    benchmark's baseline)."""
    num_tokens, k = top_ids.shape
    num_pairs = num_tokens * k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if num_tokens <= (GEMV_MAX_TOKENS if gemv_max_tokens is None else gemv_max_tokens):
        return moe_gemv(x, gate_up, down, top_ids, top_weights)
    tile = tile or default_tile(num_pairs)
    num_experts = gate_up.shape[0]
    if torch_align or num_pairs > ALIGN_CHUNK * ALIGN_MAX_CHUNKS:
        blocks = align_by_expert(top_ids, num_experts, tile.block_m)
    elif num_pairs <= SMALL_PAIRS:  # decode batches: one launch
        blocks = align_small(top_ids, num_experts, tile.block_m)
    else:
        blocks = align_chunked(top_ids, num_experts, tile.block_m)
    act = moe_gemm(x, gate_up, blocks, num_pairs, k, silu_mul=True, tile=tile)  # [T·k, I]
    weights = top_weights.flatten().float().contiguous()  # [T·k]
    out_pairs = moe_gemm(act, down, blocks, num_pairs, 1, silu_mul=False, route_weights=weights, tile=tile)
    return out_pairs.view(num_tokens, k, -1).sum(dim=1)  # [T, H]


def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_ids: torch.Tensor,
                  top_weights: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """fp32 reference of `fused_moe`, straight from the definition: each pair's expert weights gathered, `chunk`
    tokens at a time (a gather of every pair's weights at once would hold T·k expert copies)."""
    out = []
    for xs, ids, ws in zip(x.split(chunk), top_ids.split(chunk), top_weights.split(chunk)):
        h = torch.einsum("th,tknh->tkn", xs.float(), gate_up[ids].float())  # [t, k, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, down[ids].float())  # [t, k, H]
        out.append((y * ws.float()[..., None]).sum(dim=1))
    return torch.cat(out).to(x.dtype) if out else torch.zeros_like(x)
