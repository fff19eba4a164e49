"""INT4 weight-only matmuls (W4A16, issue 25): y [M, N] = x [M, K] @ Wᵀ with W held as 4-bit integers, dequantized
in registers tile by tile up to 16 tokens, and to a temporary float W for cuBLAS from 17.

The layout (internal; the loader converts AWQ and GPTQ checkpoints into it):
- qweight int32 [N, K // 8], packed along K: nibble i of word j (bits 4i..4i+3, unsigned 0..15) holds k = 8j + i;
- scales [N, K // G] and zeros [N, K // G] in the model dtype, zeros holding the integer zero point as a float;
- w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G], G (group_size) a multiple of 8 that divides K.

Four paths, picked by M and the group size (`w4a16_linear`, `config_for`; timings: H100, Llama-3.1-8B's projections,
kernel_table --w4a16-sweep, 2026-12-06):
- one token (_w4a16_gemv_kernel): one program owns BLOCK_N rows of W and covers K in steps of BLOCK_W words; it
  never materialises an unpacked tile, but multiplies nibble i of each word by x[8j + i] and applies the word's
  scale and zero once to its sums. A nibble becomes a float in one LOP3 and one FFMA (_nibble: masked in place and
  OR'd into the mantissa of 2^23). History, the batch-1 step: 18.1 ms with an unpacking reshape and a scale gathered
  per weight; 4.43 ms (2.76x its 1.61 ms roofline, 84 % of it this kernel) with shift, mask, OR and FADD per nibble;
  LOP3 + FFMA took the projections 2-5 % less (0.29-0.41 of copy bandwidth): neither the integer instructions nor
  the bytes bound it; loads in flight are the suspect (12 warps an SM at 168 registers, each step's loads waited for
  before its arithmetic). A register prefetch of the next step's loads (issued before this step's arithmetic) was
  slower at every tile on the H100 (gate_up 52.6 -> 80.0 µs at 8 x 2048) and is gone; Triton's own num_stages leaves
  this kernel unchanged. Unsolved. bench/w4a16_probe.py (H100, 2026-12-07) found the per-word scale and zero gathers
  the largest cost (gate_up 58.7 -> 33.4 µs without them), then x's strided loads (-> 42.7); CHUNK_SCALES (off until
  measured) loads each scale and zero once a chunk of 4 words instead.
- 2..16 tokens, groups of ≥ 128 columns (AWQ and GPTQ as published): _w4a16_group_kernel, the nibbles as integers
  on the tensor cores, a group a step, its scale and zero applied once to the group's [BLOCK_M, BLOCK_N] sums; split
  along K (split_for) where the tiles alone would leave SMs idle. At 8 tokens 1.9-3.4x faster than the dequantizing
  tile and 1.5x faster than dequantize-then-cuBLAS (261 against 384 µs a layer); at 64 rows a tile it was slower
  than the dequantizing tile, so it stops at 16 tokens.
- 2..16 tokens with other groups (32, 64): the dequantizing dot tile
  (_w4a16_kernel): each program dequantizes its [BLOCK_N, BLOCK_K] tile of W to x's dtype in registers (unpack by
  broadcasting each word against the shifts 0, 4, .., 28, then reshape [BLOCK_N, BLOCK_K // 8, 8] to [BLOCK_N,
  BLOCK_K], nibble i of word j at column 8j + i) and multiplies it by BLOCK_M rows of x. Its larger tiles (config_for
  past 16 tokens) serve direct w4a16_matmul calls and the sweep only: 4.5-9x bf16 cuBLAS at 64 tokens.
- DEQUANT_MIN_TOKENS (17) tokens and more, batched decode and prefill chunks: W dequantized to x's dtype by one
  streaming kernel (w4a16_dequantize), then cuBLAS; the float W is a temporary of the call. A layer of Llama-3.1-8B
  at 32 / 64 / 128 tokens: 385 / 386 / 398 µs against the dequantizing tile's 751 / 767 / 945 (bf16 cuBLAS: 175).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import pdl

DECODE_MAX_TOKENS = 16  # M up to this takes the decode (GEMV) tile; larger M the GEMM tile: see the module docstring
GROUP_TILE_MIN = 128  # columns: tl.dot's K is at least 16 words of 8 nibbles
# From this many tokens, dequantize W to x's dtype (one streaming kernel) and call cuBLAS. Timed on the H100
# (kernel_table --w4a16-sweep, 2026-12-06, Llama-3.1-8B's qkv / o / gate_up / down summed): at 8 tokens the group
# kernel 261 µs, dequantize-then-cuBLAS 384; at 32, 64 and 128 tokens the dequantizing tile 751 / 767 / 945 µs,
# dequantize-then-cuBLAS 385 / 386 / 398. So the group kernel ends where dequantizing begins.
DEQUANT_MIN_TOKENS = DECODE_MAX_TOKENS + 1
MAX_PARTS = 8  # split-K slices at most (each writes an fp32 partial [M, N])
PACK = 8  # nibbles a packed int32 word holds
MAGIC_BITS = tl.constexpr(0x4B000000)  # the float 2^23's bits: a nibble OR'd into its mantissa reads 2^23 + q
MAGIC = tl.constexpr(8388608.0)  # 2^23
CHUNK_WORDS = 4  # words (16 bytes) a thread loads at once: _w4a16_gemv_chunks's scale-sharing run
CHUNK = tl.constexpr(CHUNK_WORDS)
# One token: a scale and zero loaded once a CHUNK of words (_w4a16_gemv_chunks) where the groups allow it, instead of
# once a word. Off until measured on a GPU (bench/model_speed.py's `:w4a16_chunks` is its A/B)
CHUNK_SCALES = False


class W4A16Config(NamedTuple):
    block_m: int  # 1: the element-wise one-token path; ≥ 16: tl.dot
    block_n: int
    block_k: int  # a multiple of PACK
    num_warps: int
    num_stages: int = 1  # Triton's software pipelining of the dot kernels (the one-token kernel runs 1)


def is_group_tiled(group_size: int) -> bool:
    """Groups the tensor-core kernel takes whole, one a step (_w4a16_group_kernel): 8·2^i ≥ 128 columns."""
    words = group_size // PACK
    return group_size >= GROUP_TILE_MIN and words & (words - 1) == 0


def config_for(num_tokens: int, n: int, k: int, parts: int = 1, group_size: int | None = None) -> W4A16Config:
    """The tile for a call of up to DEQUANT_MIN_TOKENS - 1 tokens (w4a16_linear dequantizes past that). Measured on an
    H100 with kernel_table --w4a16-sweep (2026-12-06, Llama-3.1-8B's projections, groups of 128):
    - one token: 8 rows by up to 2048 columns over 4 warps, the fastest for o, gate_up and down (10.3, 50.2, 29.6 µs;
      qkv's best, 8 x 1024, 3 % faster). Each program reads x as 8 strided passes (x[8j + i] for each nibble i), so
      wider rows amortise that traffic.
    - 2..16 tokens with groups is_group_tiled takes (published AWQ/GPTQ: 128): the group kernel, 16 x 64 over 4
      warps, block_k the group. At 8 tokens it took 45.6 / 26.2 / 113.4 / 76.9 µs (qkv / o / gate_up / down): 1.3-2x
      bf16 cuBLAS, and 1.9-3.4x faster than the dequantizing tile. At 64 and 256 tokens (64 and 128 rows) it was
      2.5-5x slower than that tile, so it stops at 16.
    - otherwise the dequantizing dot tile: gemv.py's 16 x 16 x 256 up to 16 tokens; past that (not served:
      w4a16_linear dequantizes from 17 tokens) 64 x 128 x 64 over 8 warps up to 64, else 128 x 128 x 32.
    ptxas for sm_90 fits every default tile without spilling (tests/kernels/test_w4a16.py checks it offline)."""
    width = triton.next_power_of_2(max(16, k // parts))
    if num_tokens == 1:
        return W4A16Config(1, 8, min(2048, width), 4)
    if num_tokens <= DECODE_MAX_TOKENS:
        if group_size is not None and is_group_tiled(group_size):
            return W4A16Config(DECODE_MAX_TOKENS, 64, group_size, 4, 2)
        return W4A16Config(DECODE_MAX_TOKENS, 16, min(256, width), 4)
    if num_tokens <= 64:
        return W4A16Config(64, 128, min(64, width), 8, 3)
    return W4A16Config(128, 128, min(32, width), 8, 4)


def split_for(num_tokens: int, n: int, k: int, group_size: int, cfg: W4A16Config, num_sms: int) -> int:
    """How many slices of K (whole groups each) a call splits into so that its programs fill the GPU twice over: a
    64-token o projection of Llama-3.1-8B is only 64 tiles of 64 x 64 on 132 SMs. At most MAX_PARTS, 1 for one token
    (its 8-row tiles already number N / 8) and for tiles that fill the SMs alone."""
    if cfg.block_m == 1:
        return 1
    tiles = triton.cdiv(num_tokens, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    want = min(MAX_PARTS, triton.cdiv(2 * num_sms, tiles))
    groups = k // group_size
    return max(p for p in range(1, want + 1) if groups % p == 0)


@triton.jit
def _nibble(words, high, I: tl.constexpr):
    """Nibble I of each word (0..15) as a float, exactly, in one LOP3 and one FFMA a weight where shift, mask, OR and
    FADD took four: the nibble masked in place (no shift) and OR'd into the mantissa of 2^23 reads as the float
    2^23 + 16^j·q (≤ 2^23 + 15·16^4, exact), and (2^23 + 16^j·q)·16^-j − 2^23·16^-j = q, exactly (powers of two).
    Nibbles 5..7 come from `high` = words >> 12 (one shift a word), at places j = 2..4, so every mask stays below
    bit 20 and clear of the exponent."""
    if I < 5:
        f = ((words & (0xF << (4 * I))) | MAGIC_BITS).to(tl.float32, bitcast=True)
        inv = 1.0 / (1 << (4 * I))
    else:
        f = ((high & (0xF << (4 * (I - 3)))) | MAGIC_BITS).to(tl.float32, bitcast=True)
        inv = 1.0 / (1 << (4 * (I - 3)))
    return f * inv - MAGIC * inv


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
def _w4a16_gemv_step_loads(q_ptr, s_ptr, z_ptr, offs_n, mask_n, w0, w_end, words_per_group, stride_qn, stride_sn,
                           BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr):
    """One step's packed words [BLOCK_N, BLOCK_W] and each word's group scale and zero (fp32), for words w0.. (those
    from w_end on, and masked rows, load as 0)."""
    offs_w = w0 + tl.arange(0, BLOCK_W)
    if EVEN_K:
        mask = mask_n[:, None]
    else:
        mask = mask_n[:, None] & (offs_w < w_end)[None, :]
    words = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask, other=0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_W] int32
    g_off = offs_n[:, None] * stride_sn + (offs_w // words_per_group)[None, :]
    s = tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    return words, s, z


@triton.jit
def _w4a16_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, k_per_part, group_size, stride_qn, stride_sn,
                       stride_op, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       EVEN_K: tl.constexpr, CHUNK_SCALES: tl.constexpr, PDL: tl.constexpr):
    """One token: out[part, 0, n] = Σ_k x[k] w[n, k] over the part's slice of K, BLOCK_W packed words (8·BLOCK_W
    columns) of BLOCK_N rows a step. Per word, Σ_k (q − z)·s·x = s·(Σ_i q_i·x_{8j+i} − z·Σ_i x_{8j+i}): nibble i of
    every word multiplies the strided x[8j + i] (no reshape of the unpacked tile), and the word's group scale and
    zero (gathered per word, an eighth of the weights) apply once to the word's sums. EVEN_K: the part's words are
    a whole number of BLOCK_W, so no column mask (the rows' words then load as 16-byte vectors).
    CHUNK_SCALES (groups of a multiple of CHUNK words): _w4a16_gemv_chunks, the words as [BLOCK_N, BLOCK_W / CHUNK,
    CHUNK], a scale and a zero loaded once a chunk instead of once a word."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    pdl.wait(PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    words_per_group = group_size // 8
    if CHUNK_SCALES:  # the part's first word as a multiple of CHUNK the compiler sees (parts are whole groups of a
        # multiple of CHUNK words), so the words load as 16-byte vectors
        w_lo = part * (k_per_part // (8 * CHUNK)) * CHUNK
        w_end = w_lo + k_per_part // 8
        out = _w4a16_gemv_chunks(x_ptr, q_ptr, s_ptr, z_ptr, offs_n, mask_n, w_lo, w_end, words_per_group, stride_qn,
                                 stride_sn, BLOCK_N, BLOCK_W, EVEN_K)
    else:
        w_lo = part * (k_per_part // 8)
        w_end = w_lo + k_per_part // 8
        out = _w4a16_gemv_words(x_ptr, q_ptr, s_ptr, z_ptr, offs_n, mask_n, w_lo, w_end, words_per_group, stride_qn,
                                stride_sn, BLOCK_N, BLOCK_W, EVEN_K)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + part * stride_op + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _nibble_dot(words, x_ptr, offs_w, mask_w):
    """For words [BLOCK_N, *W] (offs_w [*W]: their indices, masked by mask_w): each word's Σ_i q_i·x[8w + i] [BLOCK_N,
    *W] and Σ_i x[8w + i] [*W], fp32 — nibble i of every word against the strided x[8w + i]."""
    high = words >> 12  # nibbles 5, 6, 7 at bits 8, 12, 16
    dot = tl.zeros(words.shape, dtype=tl.float32)
    xsum = tl.zeros(offs_w.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(x_ptr + offs_w * 8 + i, mask=mask_w, other=0.0).to(tl.float32)
        dot += _nibble(words, high, i) * tl.expand_dims(xi, 0)
        xsum += xi
    return dot, xsum


@triton.jit
def _w4a16_gemv_words(x_ptr, q_ptr, s_ptr, z_ptr, offs_n, mask_n, w_lo, w_end, words_per_group, stride_qn, stride_sn,
                      BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr):
    """_w4a16_gemv_kernel's sums [BLOCK_N] over words w_lo..w_end, a scale and zero gathered per word."""
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(w_lo, w_end, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        mask_w = tl.full([BLOCK_W], True, tl.int1) if EVEN_K else offs_w < w_end
        words, s, z = _w4a16_gemv_step_loads(q_ptr, s_ptr, z_ptr, offs_n, mask_n, w0, w_end, words_per_group,
                                             stride_qn, stride_sn, BLOCK_W, EVEN_K)
        dot, xsum = _nibble_dot(words, x_ptr, offs_w, mask_w)
        acc += s * (dot - z * xsum[None, :])
    return tl.sum(acc, axis=1)  # [BLOCK_N]


@triton.jit
def _w4a16_gemv_chunks(x_ptr, q_ptr, s_ptr, z_ptr, offs_n, mask_n, w_lo, w_end, words_per_group, stride_qn,
                       stride_sn, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr):
    """As _w4a16_gemv_words, with the words of a step as [BLOCK_N, BLOCK_W / CHUNK, CHUNK]: a chunk's CHUNK words lie
    in one group (groups of a multiple of CHUNK words, chunks from the part's first word), so its scale and zero load
    once as [BLOCK_N, BLOCK_W / CHUNK, 1] and broadcast. Triton lowers each load to its own instruction, so the
    2-D kernel's per-word gathers load each scale and zero CHUNK times."""
    NUM_CHUNKS: tl.constexpr = BLOCK_W // CHUNK
    offs_c = tl.arange(0, NUM_CHUNKS)
    offs_r = tl.arange(0, CHUNK)
    acc = tl.zeros([BLOCK_N, NUM_CHUNKS, CHUNK], dtype=tl.float32)
    rows = offs_n[:, None, None]
    for w0 in range(w_lo, w_end, BLOCK_W):
        offs_w = w0 + offs_c[:, None] * CHUNK + offs_r[None, :]  # [NUM_CHUNKS, CHUNK]
        first = w0 + offs_c * CHUNK  # [NUM_CHUNKS]: each chunk's first word
        if EVEN_K:
            mask = mask_n[:, None, None]
            mask_w = tl.full([NUM_CHUNKS, CHUNK], True, tl.int1)
            mask_c = mask
        else:
            mask_w = offs_w < w_end
            mask = mask_n[:, None, None] & mask_w[None, :, :]
            mask_c = mask_n[:, None, None] & (first < w_end)[None, :, None]
        words = tl.load(q_ptr + rows * stride_qn + offs_w[None, :, :], mask=mask, other=0,
                        eviction_policy="evict_first")  # [BLOCK_N, NUM_CHUNKS, CHUNK] int32
        g_off = rows * stride_sn + (first // words_per_group)[None, :, None]  # [BLOCK_N, NUM_CHUNKS, 1]
        s = tl.load(s_ptr + g_off, mask=mask_c, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=mask_c, other=0.0).to(tl.float32)
        dot, xsum = _nibble_dot(words, x_ptr, offs_w, mask_w)
        acc += s * (dot - z * xsum[None, :, :])
    return tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]


@triton.jit
def _w4a16_group_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, groups_per_part, stride_xm, stride_qn,
                        stride_sn, stride_op, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_W: tl.constexpr,
                        IEEE_DOT: tl.constexpr):
    """Two or more tokens, groups of 8·GROUP_W ≥ 128 columns: out[part, m, n] = Σ over the part's groups g of
    s[n, g]·(Σ_{k in g} x[m, k]·q[n, k] − z[n, g]·Σ_{k in g} x[m, k]). The integer nibbles go to the tensor cores
    as they are (exact in bf16), one group a step: for each nibble place i, the [BLOCK_M, GROUP_W] columns
    x[:, 8j + i] against the [GROUP_W, BLOCK_N] nibbles i (one LOP3 and one FFMA a weight: _nibble), so no tile is reshaped or transposed in registers and the scale and zero
    apply once a group to the [BLOCK_M, BLOCK_N] sums instead of once a weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, GROUP_W)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_lo = part * groups_per_part
    for g in range(g_lo, g_lo + groups_per_part):
        w_idx = g * GROUP_W + offs_w  # [GROUP_W] words of group g
        words = tl.load(q_ptr + offs_n[None, :] * stride_qn + w_idx[:, None], mask=mask_n[None, :], other=0,
                        eviction_policy="evict_first")  # [GROUP_W, BLOCK_N] int32
        high = words >> 12
        sums = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_ptr + offs_m[:, None] * stride_xm + (w_idx * 8 + i)[None, :], mask=mask_m[:, None],
                         other=0.0)  # [BLOCK_M, GROUP_W]
            xsum += tl.sum(xi.to(tl.float32), axis=1)
            q = _nibble(words, high, i)  # [GROUP_W, BLOCK_N] fp32, integers 0..15
            if IEEE_DOT:  # fp32 activations: no TF32 rounding
                sums = tl.dot(xi, q, sums, input_precision="ieee")
            else:
                sums = tl.dot(xi, q.to(xi.dtype), sums)
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        acc += (sums - xsum[:, None] * z[None, :]) * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + part * stride_op + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


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


def chunks_fit(group_size: int, block_k: int) -> bool:
    """Whether _w4a16_gemv_chunks takes these groups and this step: a group a whole number of CHUNK words (groups of
    32, 64, 128 columns), a step a whole number of chunks."""
    return (group_size % (PACK * CHUNK_WORDS) == 0 and (block_k // PACK) % CHUNK_WORDS == 0
            and block_k // PACK >= CHUNK_WORDS)


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
    cfg = config or config_for(num_tokens, n, k, parts, group_size)
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
            BLOCK_W=cfg.block_k // PACK, EVEN_K=k_per_part % cfg.block_k == 0,
            CHUNK_SCALES=CHUNK_SCALES and chunks_fit(group_size, cfg.block_k), num_warps=cfg.num_warps, num_stages=1,
            **pdl.args(x.device))
        return out[0] if parts == 1 else out
    grid = (triton.cdiv(num_tokens, cfg.block_m), triton.cdiv(n, cfg.block_n), parts)
    if cfg.block_k == group_size and is_group_tiled(group_size):
        _w4a16_group_kernel[grid](
            x, qweight, scales, zeros, bias if bias is not None else scales, out, num_tokens, n,
            k_per_part // group_size, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            GROUP_W=group_size // PACK, IEEE_DOT=x.dtype == torch.float32, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return out[0] if parts == 1 else out
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, num_tokens, n, k_per_part, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ONE_GROUP=group_size % cfg.block_k == 0,
        IEEE_DOT=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out[0] if parts == 1 else out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ (+ bias) → [M, N] in x's dtype, W the INT4 weight (layout: module docstring): from
    DEQUANT_MIN_TOKENS tokens W dequantized to x's dtype and cuBLAS; else config_for's tile, the group kernel split
    along K where its tiles alone would leave SMs idle (split_for; the partials summed here)."""
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"w4a16_linear takes x [M ≥ 1, K], not {tuple(x.shape)}")
    (num_tokens, k), n = x.shape, qweight.shape[0]
    if num_tokens >= DEQUANT_MIN_TOKENS:
        _check_layout(x, qweight, scales, zeros, group_size)
        return torch.nn.functional.linear(x, w4a16_dequantize(qweight, scales, zeros, group_size, x.dtype), bias)
    cfg = config_for(num_tokens, n, k, 1, group_size)
    is_group = cfg.block_k == group_size and is_group_tiled(group_size) and k % group_size == 0
    parts = split_for(num_tokens, n, k, group_size, cfg, _num_sms(x.device)) if is_group else 1
    if parts == 1:
        return w4a16_matmul(x, qweight, scales, zeros, group_size, bias, config=cfg)
    out = w4a16_matmul(x, qweight, scales, zeros, group_size, None, parts, cfg).sum(0)
    return (out if bias is None else out + bias.float()).to(x.dtype)


@triton.jit
def _w4a16_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, stride_qn, stride_sn, stride_on,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_GROUP: tl.constexpr):
    """out[n, k] = (q[n, k] − z[n, k // G])·s[n, k // G] for a [BLOCK_N, BLOCK_K] tile, in out's dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, mask_n, k0, K, group_size, stride_qn, stride_sn, BLOCK_N, BLOCK_K,
                      ONE_GROUP)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_n[:, None] & (offs_k < K)[None, :])


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The float W [N, K] in `dtype`, in one streaming kernel (half a byte read, 2 written a weight): the large-M
    path's temporary, freed when the call's GEMM is done."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_k = min(128, triton.next_power_of_2(k))
    _w4a16_dequant_kernel[(triton.cdiv(n, 32), triton.cdiv(k, block_k))](
        qweight, scales, zeros, out, n, k, group_size, qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_N=32, BLOCK_K=block_k, ONE_GROUP=group_size % block_k == 0, num_warps=4)
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


_SMS: dict[int | None, int] = {}


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
