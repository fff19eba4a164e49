"""INT4 weight-only matmuls (W4A16, issue 25): y [M, N] = x [M, K] @ Wᵀ with W held as 4-bit integers, dequantized
in registers tile by tile; the float W [N, K] is never written to memory.

The layout (internal; the loader converts AWQ and GPTQ checkpoints into it):
- qweight int32 [N, K // 8], packed along K: nibble i of word j (bits 4i..4i+3, unsigned 0..15) holds k = 8j + i;
- scales [N, K // G] and zeros [N, K // G] in the model dtype, zeros holding the integer zero point as a float;
- w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G], G (group_size) a multiple of 8 that divides K.

One kernel, two kinds of tile, picked by M (`w4a16_linear`):
- decode, M ≤ DECODE_MAX_TOKENS (16): the GEMV of kernels/gemv.py with the weight unpacked on the fly. One program
  owns BLOCK_N rows of W and one of `parts` slices of K and covers every row of x, so each packed word is read and
  dequantized once a call. One token has a kernel of its own (_w4a16_gemv_kernel): it never materialises the
  unpacked [BLOCK_N, BLOCK_K] tile, but multiplies nibble i of each word by x[8j + i] and applies the word's scale
  and zero once to its sums (the first version unpacked by reshape and gathered a scale and a zero per weight: on an
  H100, Llama-3.1-8B's batch-1 step took 18.1 ms, 11.2x its roofline, 96 % of it in this kernel). 2..16 tokens pad
  x to 16 rows and use tl.dot.
- prefill, M > 16: a tiled GEMM (BLOCK_M x BLOCK_N x BLOCK_K, tl.dot): each program dequantizes its [BLOCK_N,
  BLOCK_K] tile of W to x's dtype in registers and multiplies it by BLOCK_M rows of x, so W is read and dequantized
  cdiv(M, BLOCK_M) times — once per 64 or 128 rows.

Why 16: tl.dot's narrowest M tile is 16, so up to 16 tokens fit one M block and the decode tile reads W once. Past
16 the decode tile would read and unpack all of W again for every 16 rows; the GEMM tile's 64 or 128 rows amortise
the unpacking and feed the tensor cores a full tile. The alternative for prefill — dequantize all of W to the model
dtype once a call, then torch.nn.functional.linear — moves 4.5 bytes a weight (read the half byte, write and read 2)
instead of half a byte a BLOCK_M rows, and needs an N x K temporary per call; at large M both are compute-bound, and
whether cuBLAS on the temporary would beat this Triton GEMM there is unmeasured.

In the dot tiles, words are unpacked by broadcasting each loaded word against the 8 shifts 0, 4, .., 28 and masking
with 0xF (a negative int32 shifts arithmetically, but the mask keeps only the nibble), then reshaping [BLOCK_N,
BLOCK_K // 8, 8] to [BLOCK_N, BLOCK_K], which puts nibble i of word j at column 8j + i. A block of K inside one group (G a multiple
of BLOCK_K) loads one scale and zero per row; otherwise each column gathers its group's.

Tiles are untuned (no GPU has timed them); ptxas for sm_90 fits them without spills: `config_for` below.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

DECODE_MAX_TOKENS = 16  # M up to this takes the decode (GEMV) tile; larger M the GEMM tile: see the module docstring
PACK = 8  # nibbles a packed int32 word holds
MAGIC_BITS = tl.constexpr(0x4B000000)  # the float 2^23's bits: a nibble OR'd into its mantissa reads 2^23 + q
MAGIC = tl.constexpr(8388608.0)  # 2^23


class W4A16Config(NamedTuple):
    block_m: int  # 1: the element-wise one-token path; ≥ 16: tl.dot
    block_n: int
    block_k: int  # a multiple of PACK
    num_warps: int
    num_stages: int = 1


def config_for(num_tokens: int, n: int, k: int, parts: int = 1) -> W4A16Config:
    """Untuned tiles, chosen only so that ptxas for sm_90 fits each in registers without spilling (bf16, both ways of
    loading scales; tests/kernels/test_w4a16.py checks it offline). One token: 8 rows by up to 1024 columns over 4
    warps. The bf16 GEMV's best tiles are 2 rows wide, but here each program reads x as 8 strided passes (x[8j + i]
    for each nibble i: 16 bytes of sector for each 2-byte element), so that traffic is 32 / BLOCK_N times the packed
    weights' own; 2 rows by 4096 served Llama-3.1-8B's batch-1 step in 5.00 ms on an H100 (roofline 1.61), with an
    int→float conversion a nibble, since replaced. 8 x 1024 is reasoned, not yet timed (kernel_table --w4a16-sweep).
    2..16 tokens: gemv.py's 16 x 16 x 256 dot tile. Prefill: 64 x 128 x 64 over 8 warps up to 64 rows (4 warps spilled),
    else 128 x 128 x 32 (x 64 spilled with per-column scales)."""
    width = triton.next_power_of_2(max(16, k // parts))
    if num_tokens == 1:  # 8 rows by 1024 columns: each program's strided reads of x serve 8 rows of W
        return W4A16Config(1, 8, min(1024, width), 4)
    if num_tokens <= DECODE_MAX_TOKENS:
        return W4A16Config(DECODE_MAX_TOKENS, 16, min(256, width), 4)
    if num_tokens <= 64:
        return W4A16Config(64, 128, min(64, width), 8, 3)
    return W4A16Config(128, 128, min(32, width), 8, 4)


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, mask_n, k_start, k_end, group_size, stride_qn, stride_sn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr):
    """W[offs_n, k_start:k_start + BLOCK_K] in fp32, [BLOCK_N, BLOCK_K], from the packed words; columns from k_end
    on (a multiple of 8, as k_start is) and masked-off rows come out 0. ONE_GROUP: the block lies in one group."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_end
    offs_w = k_start // 8 + tl.arange(0, BLOCK_K // 8)
    mask_w = offs_w < k_end // 8
    words = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask_n[:, None] & mask_w[None, :],
                    other=0, eviction_policy="evict_first")
    shifts = tl.arange(0, 8) * 4
    q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K]).to(tl.float32)
    if ONE_GROUP:
        g_off = offs_n * stride_sn + k_start // group_size
        s = tl.load(s_ptr + g_off, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + g_off, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    else:
        g_off = offs_n[:, None] * stride_sn + (offs_k // group_size)[None, :]
        g_mask = mask_n[:, None] & mask_k[None, :]
        s = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
    return (q - z) * s


@triton.jit
def _w4a16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, k_per_part, group_size, stride_qn, stride_sn,
                       stride_op, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       EVEN_K: tl.constexpr):
    """One token: out[part, 0, n] = Σ_k x[k] w[n, k] over the part's slice of K, BLOCK_W packed words (8·BLOCK_W
    columns) of BLOCK_N rows a step. Per word, Σ_k (q − z)·s·x = s·(Σ_i q_i·x_{8j+i} − z·Σ_i x_{8j+i}): nibble i of
    every word multiplies the strided x[8j + i] (no reshape of the unpacked tile), and the word's group scale and
    zero (gathered per word, an eighth of the weights) apply once to the word's sums. EVEN_K: the part's words are
    a whole number of BLOCK_W, so no column mask (the rows' words then load as 16-byte vectors)."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_lo = part * (k_per_part // 8)  # first word of this part
    w_end = w_lo + k_per_part // 8
    words_per_group = group_size // 8
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(w_lo, w_end, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        if EVEN_K:
            mask_w = tl.full([BLOCK_W], True, tl.int1)
            mask = mask_n[:, None]
        else:
            mask_w = offs_w < w_end
            mask = mask_n[:, None] & mask_w[None, :]
        words = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask, other=0,
                        eviction_policy="evict_first")  # [BLOCK_N, BLOCK_W] int32
        dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_ptr + offs_w * 8 + i, mask=mask_w, other=0.0).to(tl.float32)  # [BLOCK_W]
            # the nibble as a float without an int→float conversion (a quarter-rate instruction): its bits OR'd into
            # 2^23's mantissa give the float 2^23 + q exactly, and subtracting 2^23 leaves q
            q = (((words >> (4 * i)) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC
            dot += q * xi[None, :]
            xsum += xi
        g_off = offs_n[:, None] * stride_sn + (offs_w // words_per_group)[None, :]
        s = tl.load(s_ptr + g_off, mask=mask & mask_w[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=mask & mask_w[None, :], other=0.0).to(tl.float32)
        acc += s * (dot - z * xsum[None, :])
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + part * stride_op + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, k_per_part, group_size, stride_xm, stride_qn,
                  stride_sn, stride_op, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr, IEEE_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_lo = part * k_per_part
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for k0 in range(0, k_per_part, BLOCK_K):
        offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, mask_n, k_lo + k0, k_lo + k_per_part, group_size, stride_qn,
                          stride_sn, BLOCK_N, BLOCK_K, ONE_GROUP)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < k_lo + k_per_part)[None, :], other=0.0)
        if IEEE_DOT:  # fp32 activations: no TF32 rounding
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + part * stride_op + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_layout(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> None:
    k, n = x.shape[-1], qweight.shape[0]
    if group_size % PACK or k % group_size:
        raise ValueError(f"w4a16: group_size {group_size} must be a multiple of {PACK} that divides K = {k}")
    expected = {"qweight": (n, k // PACK), "scales": (n, k // group_size), "zeros": (n, k // group_size)}
    for name, t in ("qweight", qweight), ("scales", scales), ("zeros", zeros):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"w4a16: {name} is {tuple(t.shape)}, not {expected[name]} (x {tuple(x.shape)}, "
                             f"group_size {group_size})")
    if qweight.dtype != torch.int32:
        raise ValueError(f"w4a16: qweight must be int32, not {qweight.dtype}")


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, parts: int = 1,
                 config: W4A16Config | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ (+ bias) → [M, N] in x's dtype, or with parts > 1 the fp32 partials [parts, M, N] over `parts`
    equal slices of K, each whole groups (no bias then), as kernels/gemv.py's. `config` (default `config_for`) picks
    the tile; block_m 1 serves one token only."""
    (num_tokens, k), n = x.shape, qweight.shape[0]
    _check_layout(x, qweight, scales, zeros, group_size)
    if (k // group_size) % parts or (parts > 1 and bias is not None):
        raise ValueError(f"w4a16: parts {parts} must divide the {k // group_size} groups of K, and partials take "
                         f"no bias")
    cfg = config or config_for(num_tokens, n, k, parts)
    if cfg.block_k % PACK or (cfg.block_m == 1 and num_tokens != 1):
        raise ValueError(f"w4a16: tile {cfg} for {num_tokens} tokens: block_k must be a multiple of {PACK}, "
                         f"block_m 1 serves one token")
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    out = torch.empty((parts, num_tokens, n), dtype=x.dtype if parts == 1 else torch.float32, device=x.device)
    k_per_part = k // parts
    if cfg.block_m == 1:
        _w4a16_gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
            x, qweight, scales, zeros, bias if bias is not None else scales, out, n, k_per_part, group_size,
            qweight.stride(0), scales.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n,
            BLOCK_W=cfg.block_k // PACK, EVEN_K=k_per_part % cfg.block_k == 0, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out[0] if parts == 1 else out
    grid = (triton.cdiv(num_tokens, cfg.block_m), triton.cdiv(n, cfg.block_n), parts)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, num_tokens, n, k_per_part, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ONE_GROUP=group_size % cfg.block_k == 0,
        IEEE_DOT=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out[0] if parts == 1 else out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ (+ bias) → [M, N] in x's dtype, W the INT4 weight (layout: module docstring). M ≤
    DECODE_MAX_TOKENS takes the decode tile (W read once), larger M the GEMM tile."""
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"w4a16_linear takes x [M ≥ 1, K], not {tuple(x.shape)}")
    return w4a16_matmul(x, qweight, scales, zeros, group_size, bias)


def unpack_reference(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [N, K // 8] → the 4-bit integers [N, K] (int32, 0..15): nibble i of word j is column 8j + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)


def dequantize_reference(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """The float weight W [N, K] in scales' dtype, in pure torch (computed in fp32): the tests' reference."""
    q = unpack_reference(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return ((q - z) * s).to(scales.dtype)
