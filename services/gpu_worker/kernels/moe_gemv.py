"""The mixture-of-experts MLP of a decode step of few tokens, as matrix-vector products: two launches, no expert sort.

At batch 1 a Qwen3-30B-A3B layer routes 8 (token, expert) pairs to 8 different experts, so the grouped GEMM of
kernels/fused_moe.py runs 16-row tl.dot tiles of which one row is real, on 96 programs for the gate_up pass (too few
to keep an H100's memory busy: 1.6 TB/s), after an alignment launch and before a top-k combine launch. Here each
pair is a row of its own and no tile is padded:

    _gate_up_kernel  one program per (BLOCK_N columns of I, pair): the pair's token row against BLOCK_N gate rows and
                     the BLOCK_N up rows of the pair's expert, element-wise into [BLOCK_N, BLOCK_K] fp32
                     accumulators summed once at the end (as kernels/gemv.py at one token), then silu(gate)·up →
                     act [T·k, I] in x's dtype.
    _down_kernel     one program per (BLOCK_N columns of H, token): the token's k rows of act, each times its routing
                     weight, against the BLOCK_N rows of each pair's expert's down weight, all into one accumulator:
                     the k experts' down projections and the top-k combine are one matrix-vector product over the
                     k·I long concatenation, written once in x's dtype. No atomics, no partials. Each step loads the
                     tiles of all k experts as one [k, BLOCK_N, BLOCK_K] block: walking the experts one at a time
                     (one small load in flight a program) read at 0.54 of copy bandwidth in the H100 model where
                     gate_up read at 0.89, and took 37.8 against 32.5 µs a layer at one token.

The experts are read as published by the router (top_ids, top_weights), so nothing waits on a sort. A pair's weights
are read once per pair: tokens that share an expert read it again (from L2 if close in time), so this path is for
few tokens (fused_moe.GEMV_MAX_TOKENS); past that the grouped GEMM reads each expert once.

Weights in moe.py's layout: gate_up [E, 2I, H] (gate rows first), down [E, H, I].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl


class GemvTile(NamedTuple):
    block_n: int  # weight rows a program owns (per half, for gate_up)
    block_k: int  # columns a step
    num_warps: int = 4
    num_stages: int = 1


class MoeGemvConfig(NamedTuple):
    gate_up: GemvTile
    down: GemvTile


def default_config(hidden: int, inter: int) -> MoeGemvConfig:
    """Measured on an H100 for Qwen3-30B-A3B (bench/kernel_table.py --moe-gemv-sweep, 2026-12-07; layer µs at 1 / 2
    / 4 tokens, the grouped GEMM's best tile 37.8 / 66.3 / 113.0): gate_up in tiles of 4 rows by 512 columns, two
    stages, where kernels/gemv.py's one-token tile (2 rows by the whole 2048-column row) took 46.1 / 78.8 / 145.6;
    down in tiles of 2 rows by 128 columns, 32.5 / 59.8 / 107.8 (one expert a step in 4 x 256, the kernel before
    it: 37.8 / 61.4 / 111.6)."""
    return MoeGemvConfig(GemvTile(4, min(512, triton.next_power_of_2(hidden)), 4, 2),
                         GemvTile(2, min(128, triton.next_power_of_2(inter)), 4, 1))


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, N, K, stride_xm, stride_we, stride_wn, stride_am,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    pdl.wait(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    gate_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + N * stride_wn  # the up rows sit N rows below the gate rows
    x_row = x_ptr + token * stride_xm
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask = mask_n[:, None]
            x = tl.load(x_row + offs_k)
        else:
            mask = mask_n[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0)
        gate = tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0)
        up = tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)[None, :]
        acc_gate += gate.to(tl.float32) * xf
        acc_up += up.to(tl.float32) * xf
    gate_sum = tl.sum(acc_gate, axis=1)
    act = gate_sum / (1.0 + tl.exp(-gate_sum)) * tl.sum(acc_up, axis=1)  # [BLOCK_N]
    tl.store(act_ptr + pair * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_kernel(a_ptr, w_ptr, ids_ptr, route_w_ptr, out_ptr, N, K, stride_am, stride_we, stride_wn, stride_om,
                 TOP_K: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    pdl.wait(PDL)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < TOP_K
    pairs = token * TOP_K + offs_j  # [J]
    experts = tl.load(ids_ptr + pairs, mask=mask_j, other=0).to(tl.int64)
    route_w = tl.load(route_w_ptr + pairs, mask=mask_j, other=0.0).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn  # [J, N, 1]
    a_rows = a_ptr + pairs[:, None].to(tl.int64) * stride_am  # [J, 1]
    mask_jn = mask_j[:, None, None] & mask_n[None, :, None]
    acc = tl.zeros([BLOCK_J, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(rows + offs_k[None, None, :], mask=mask_jn, other=0.0)
            a = tl.load(a_rows + offs_k[None, :], mask=mask_j[:, None], other=0.0)
        else:
            mask_k = offs_k < K
            w = tl.load(rows + offs_k[None, None, :], mask=mask_jn & mask_k[None, None, :], other=0.0)
            a = tl.load(a_rows + offs_k[None, :], mask=mask_j[:, None] & mask_k[None, :], other=0.0)
        acc += w.to(tl.float32) * (a.to(tl.float32) * route_w[:, None])[:, None, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=0)  # [BLOCK_N]
    tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


def moe_gemv(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_ids: torch.Tensor,
             top_weights: torch.Tensor, config: MoeGemvConfig | None = None) -> torch.Tensor:
    """fused_moe.fused_moe's result on two matrix-vector launches: x [T, H]; gate_up [E, 2I, H]; down [E, H, I];
    top_ids [T, k]; top_weights [T, k] → Σ_j top_weights[t, j] · down_e · (silu(gate_e · x_t) · up_e · x_t), [T, H]
    in x's dtype. The intermediate act is rounded to x's dtype, as the grouped GEMM's is; the k products are summed
    in fp32."""
    num_tokens, k = top_ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    assert x.shape == (num_tokens, hidden) and down.shape == (num_experts, hidden, inter)
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    if num_tokens == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(hidden, inter)
    ids = top_ids.contiguous()
    weights = top_weights.float().contiguous()
    act = torch.empty((num_tokens * k, inter), dtype=x.dtype, device=x.device)
    gu = cfg.gate_up
    _gate_up_kernel[(triton.cdiv(inter, gu.block_n), num_tokens * k)](
        x, gate_up, ids, act, inter, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=k, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=hidden % gu.block_k == 0,
        num_warps=gu.num_warps, num_stages=gu.num_stages, **pdl.args(x.device))
    out = torch.empty_like(x)
    dn = cfg.down
    _down_kernel[(triton.cdiv(hidden, dn.block_n), num_tokens)](
        act, down, ids, weights, out, hidden, inter, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        TOP_K=k, BLOCK_J=triton.next_power_of_2(k), BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
        EVEN_K=inter % dn.block_k == 0, num_warps=dn.num_warps, num_stages=dn.num_stages, **pdl.args(x.device))
    return out
