"""Matrix-vector products of decode steps of few tokens: x [M, K] @ weight [N, K]ᵀ for M ≤ MAX_TOKENS, in Triton.

Opt-in (EngineConfig.gemv_max_tokens, 0 by default): the engine's matmuls run on cuBLAS unless it is set. At one
token cuBLAS reads the q/k/v and o weights at 0.68 and 0.54 of the H200's copy bandwidth; this kernel reads them at
0.80 and 0.73, and the engine's batch-1 step with it takes 0.928 of cuBLAS's time. At 8 tokens its dot path is
slower than cuBLAS.

Each program owns BLOCK_N rows of the weight and one of `parts` equal slices of K, and walks its slice BLOCK_K
columns at a time. With one token it multiplies element-wise into a [BLOCK_N, BLOCK_K] fp32 accumulator and sums
across K once at the end; with 2..16 tokens it pads x to 16 rows and uses tl.dot. parts = 1 writes [M, N] in x's
dtype (plus the bias, if any); parts > 1 writes the fp32 partials [parts, M, N] that kernels/rms_norm.py sums, as
model/fused.py's split-K cuBLAS call does.

FP8 weights (quant/fp8.py's e4m3 [N, K] with a float32 scale per row) take the same path with `scale`: the weight
is widened in registers and each row's dot product multiplied by its scale, x staying in its own dtype (W8A16: at
one token the bytes are the weight's, and quantizing x would only add error).

Which tile a shape gets: TUNED[(n, k, parts, m_bucket)] where present (measured on the H200), else
`heuristic_config`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl

MAX_TOKENS = 16  # the dot path pads x to 16 rows
# o_proj's and down_proj's slices of K on this kernel (model/fused.py); 1: whole rows in the activation dtype, which
# also spares the next RMSNorm the sum of fp32 partials. On the H200, o + down at one token: 44.2 µs at 1 part, 44.4
# at 2, 45.5 at 4.
ROW_PARTS = 1


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1


# (n, k, parts, m_bucket) → GemvConfig; m_bucket is 1 (one token) or 16 (2..16 tokens). The H200's fastest tiles at
# one token for Llama-3.1-8B's projections at ROW_PARTS (bench/kernel_table.py --gemv-sweep, then gemv_tuning): of
# 64 tiles each, then of 12 around the best. The dot path at 8 tokens was slower than cuBLAS with every tile tried,
# so it has no entries.
TUNED: dict[tuple[int, int, int, int], GemvConfig] = {
    (6144, 4096, 1, 1): GemvConfig(2, 4096, 4),  # q/k/v: 14.92 µs, cuBLAS 17.46
    (4096, 4096, 1, 1): GemvConfig(2, 4096, 4),  # o: 10.81 µs, cuBLAS 14.67 (12.24 split-K in 4, the engine's form)
    (28672, 4096, 1, 1): GemvConfig(2, 4096, 4),  # gate/up: 58.02 µs, cuBLAS 63.76
    (4096, 14336, 1, 1): GemvConfig(4, 2048, 4),  # down: 32.89 µs, cuBLAS 35.90 (33.95 split-K in 4)
    (128256, 4096, 1, 1): GemvConfig(2, 4096, 4),  # LM head: 241.0 µs, cuBLAS 252.1
    # Qwen3-30B-A3B's dense projections on an H100 (kernel_table --gemv-sweep --gemv-model qwen3-30b-a3b, 2026-12-07,
    # 32 tiles a shape; the H200 unmeasured); o's best is the heuristic's 2 x 4096 (8.15 µs, cuBLAS 11.49)
    (5120, 2048, 1, 1): GemvConfig(1, 512, 4),  # q/k/v: 9.65 µs (0.72 of copy), heuristic 2 x 2048 10.16
    (151936, 2048, 1, 1): GemvConfig(4, 2048, 4),  # LM head: 206.8 µs (0.998), heuristic 2 x 2048 211.1
}


# The same for e4m3 weights (W8A16, quant/fp8.py) at one token: half the bytes a row, so wider tiles win. From
# kernel_table --fp8-gemv-sweep on an H100 (2026-12-06; 32 tiles a shape; the H200 unmeasured): per layer 90.2 µs
# where TUNED's bf16 tiles took 101.8. Shapes it lacks take TUNED's tile.
TUNED_FP8: dict[tuple[int, int, int, int], GemvConfig] = {
    (6144, 4096, 1, 1): GemvConfig(4, 1024, 4),  # q/k/v: 12.34 µs (0.68 of copy), bf16's tile 13.77
    (4096, 4096, 1, 1): GemvConfig(4, 1024, 4),  # o: 8.63 µs (0.65), bf16's tile 10.16
    (28672, 4096, 1, 1): GemvConfig(4, 1024, 4),  # gate/up: 44.89 µs (0.87), bf16's tile 53.35
    (4096, 14336, 1, 1): GemvConfig(2, 2048, 4),  # down: 24.33 µs (0.80), bf16's tile 24.51
}


def m_bucket(num_tokens: int) -> int:
    return 1 if num_tokens == 1 else MAX_TOKENS


def heuristic_config(n: int, k: int, parts: int, num_tokens: int) -> GemvConfig:
    """Shapes TUNED lacks. At one token the H200's best tiles for Llama-3.1-8B: a part of K up to 4096 columns in one
    tile of 2 rows, a longer one in tiles of 4 rows by 2048; 4 warps. With more tokens a 16 x 16 x 256 dot tile."""
    width = triton.next_power_of_2(max(16, k // parts))
    if num_tokens > 1:
        return GemvConfig(16, min(256, width), 4)
    return GemvConfig(2, width, 4) if width <= 4096 else GemvConfig(4, 2048, 4)


def config_for(n: int, k: int, parts: int, num_tokens: int, fp8: bool = False) -> GemvConfig:
    key = (n, k, parts, m_bucket(num_tokens))
    return (fp8 and TUNED_FP8.get(key)) or TUNED.get(key) or heuristic_config(n, k, parts, num_tokens)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, out_ptr, M, N, k_per_part, stride_xm, stride_wn, stride_op,
                 stride_om, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_lo = part * k_per_part
    w_rows = w_ptr + offs_n[:, None] * stride_wn + k_lo
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        k_start = 0
        if PDL:  # the first tile of weights while the kernel before still runs (no kernel writes a weight)
            offs_k = tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_per_part
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            pdl.wait(PDL)
            x = tl.load(x_ptr + k_lo + offs_k, mask=mask_k, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
            k_start = BLOCK_K
        for k0 in range(k_start, k_per_part, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k_lo + offs_k)
            else:
                mask_k = offs_k < k_per_part
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptr + k_lo + offs_k, mask=mask_k, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        pdl.wait(PDL)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_rows = x_ptr + offs_m[:, None] * stride_xm + k_lo
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_per_part, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_per_part
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # an e4m3 weight widened exactly; else a no-op
    offs_m = tl.arange(0, BLOCK_M)
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + part * stride_op + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: int = 1,
         config: GemvConfig | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (1 ≤ M ≤ MAX_TOKENS), weight [N, K] → x @ weightᵀ (+ bias): [M, N] in x's dtype, or with parts > 1
    the fp32 partials [parts, M, N] over `parts` equal slices of K (no bias then; parts must divide K).

    scale: float32 [N], each weight row's scale (an e4m3 weight's): x @ (weight · scale)ᵀ."""
    (num_tokens, k), n = x.shape, weight.shape[0]
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1 to {MAX_TOKENS} rows, not {num_tokens}")
    if weight.shape[1] != k or k % parts or (parts > 1 and bias is not None):
        raise ValueError(f"gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, parts {parts}, "
                         f"bias {bias is not None}: K must match and divide into parts, and partials take no bias")
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert scale is None or (scale.dtype == torch.float32 and scale.shape == (n,) and scale.stride(0) == 1)
    cfg = config or config_for(n, k, parts, num_tokens, fp8=weight.element_size() == 1)
    if parts == 1:
        out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
        stride_op = 0
    else:
        out = torch.empty((parts, num_tokens, n), dtype=torch.float32, device=x.device)
        stride_op = out.stride(0)
    k_per_part = k // parts
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, out, num_tokens, n,
        k_per_part, x.stride(0), weight.stride(0), stride_op, out.stride(-2), HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        BLOCK_M=1 if num_tokens == 1 else MAX_TOKENS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k_per_part % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.args(x.device))
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             parts: int = 1, scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 reference of `gemv`: [M, N] in x's dtype, or the partials [parts, M, N] fp32."""
    if scale is not None:
        weight = weight.float() * scale[:, None]
    if parts == 1:
        out = x.float() @ weight.float().t()
        return (out if bias is None else out + bias.float()).to(x.dtype)
    k = x.shape[1] // parts
    return torch.stack([x[:, i * k:(i + 1) * k].float() @ weight[:, i * k:(i + 1) * k].float().t()
                        for i in range(parts)])
