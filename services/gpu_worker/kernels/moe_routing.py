"""The mixture-of-experts router on the GPU, in two launches a layer of a decode step, fixed sizes and no host sync:

    norm_router   the layer's post-attention residual add and RMSNorm (kernels/rms_norm.py's arithmetic) fused with
                  the router's logits: each program norms the token itself and multiplies it by ROUTER_ROWS rows of
                  the router's weight; the first program of each token also writes the normed activation and the
                  new residual. For decode steps of few tokens, where the router's E × hidden GEMV (0.5 MB in
                  Qwen3-30B-A3B) and the norm are each a launch of a few µs.
    route_topk    router logits [T, E] → the top k experts of each token's softmax, renormalised to sum 1 when
                  asked; one program per token instead of torch's softmax, topk and division (3-5 launches).

With fused_moe.align_small they took ~15 launches of tiny kernels out of each MoE layer of a decode step (at batch 1
a Qwen3-30B-A3B layer routes 8 pairs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl

# A program's warps. Its 2·TOP_K reductions over E logits run one after another; in one warp each is register
# shuffles only, in several each also crosses warps through shared memory behind a barrier. On an H100, 128 experts
# top-8 (kernel_table --moe-gemv-sweep, 2026-12-07), µs at 1 / 64 / 256 tokens: 1 warp 2.81 / 2.96 / 3.05, 2 warps
# 3.68 / 3.85 / 3.93, 4 warps 3.90 / 4.07 / 4.25.
ROUTE_WARPS = 1
ROUTER_ROWS = 2  # norm_router: router rows a program (64 programs for Qwen3-MoE's 128 experts)


@triton.jit
def _norm_router_kernel(h_ptr, res_ptr, nw_ptr, rw_ptr, out_ptr, res_out_ptr, logits_ptr, stride_part, stride_h,
                        stride_r, stride_o, stride_ro, stride_l, stride_rw, hidden, num_experts, eps,
                        NUM_PARTS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    pid = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    rows = pid * ROWS + tl.arange(0, ROWS)
    router = tl.load(rw_ptr + rows[:, None] * stride_rw + offs[None, :],
                     mask=(rows < num_experts)[:, None] & mask[None, :], other=0.0)  # [ROWS, BLOCK]: no wait on x
    w = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.wait(PDL)  # the weights above may load while the kernel before runs
    r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
    if NUM_PARTS == 1:
        x = tl.load(h_ptr + t * stride_h + offs, mask=mask, other=0.0)
    else:  # split-K partials of the projection before: summed, rounded as cuBLAS would write them
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for part in tl.static_range(NUM_PARTS):
            acc += tl.load(h_ptr + part * stride_part + t * stride_h + offs, mask=mask, other=0.0)
        x = acc.to(r.dtype)
    # NOTE: as _rms_norm_kernel: the sum rounded to the activation dtype, the normed value rounded before the weight
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    y = ((x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    if pid == 0:
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=mask)
        tl.store(out_ptr + t * stride_o + offs, y, mask=mask)
    logits = tl.sum(router.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)  # [ROWS]
    tl.store(logits_ptr + t * stride_l + rows, logits.to(logits_ptr.dtype.element_ty), mask=rows < num_experts)


def norm_router(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                router_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, residual [T, hidden], norm_weight [hidden], router_weight [E, hidden] → (x = norm(h + residual) · w,
    h + residual, logits x @ router_weightᵀ [T, E]), all in residual's dtype: rms_norm's two outputs and the
    router's logits in one launch. h may be split-K partials [S, T, hidden] fp32, as rms_norm takes them."""
    parts = h if h.dim() == 3 else h.unsqueeze(0)  # [S, T, hidden]
    num_parts, num_tokens, hidden = parts.shape
    num_experts = router_weight.shape[0]
    assert parts.stride(2) == 1 and residual.stride(1) == 1 and router_weight.stride(1) == 1
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    logits = torch.empty((num_tokens, num_experts), dtype=residual.dtype, device=residual.device)
    block = triton.next_power_of_2(hidden)
    if num_tokens:
        _norm_router_kernel[(num_tokens, triton.cdiv(num_experts, ROUTER_ROWS))](
            parts, residual, norm_weight, router_weight, out, res_out, logits, parts.stride(0), parts.stride(1),
            residual.stride(0), out.stride(0), res_out.stride(0), logits.stride(0), router_weight.stride(0), hidden,
            num_experts, eps, NUM_PARTS=num_parts, BLOCK=block, ROWS=ROUTER_ROWS,
            num_warps=min(16, max(1, block // 256)),  # rms_norm's warps: its sum of squares in the same order
            **pdl.args(residual.device))
    return out, res_out, logits


@triton.jit
def _route_topk_kernel(logits_ptr, ids_ptr, weights_ptr, stride_l, num_experts, TOP_K: tl.constexpr,
                       NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    pdl.wait(PDL)
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
                                          num_warps=num_warps or ROUTE_WARPS, **pdl.args(logits.device))
    return ids, weights


def route_topk_ref(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.SparseMoe's torch router, on given logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True) if normalize else weights
