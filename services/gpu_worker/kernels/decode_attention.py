"""Paged decode attention (one new query token per sequence), GQA-aware and split-K (flash-decoding).

Grid (B, KVH, NUM_SPLITS): one program holds all GROUP = H / KVH query heads of one KV head, so each K/V
tile is read once for the whole group. A sequence's keys [0, seq_len) are cut into NUM_SPLITS chunks at run
time (from seq_lens on the device), which keeps the grid fixed for a CUDA graph; a second kernel merges the
chunks' partial outputs by their log-sum-exp. With NUM_SPLITS == 1 the first kernel writes the output itself.

decode_attention_rope() also does what rope_kv_write_ does, for a decode step: it reads the step's un-rotated
q and k, rotates them in registers, attends to the cached keys [0, seq_len - 1) plus the new token held in
registers, and the split that owns position seq_len - 1 writes the rotated k and v into their cache slot.
That is one launch fewer per layer.

A layer's LayerAttention (attention/base.py: Gemma 2) picks other variants at compile time: SOFTCAP (logits →
SOFTCAP · tanh(logits / SOFTCAP) before the softmax) and WINDOW (the query at seq_len - 1 sees keys
[seq_len - WINDOW, seq_len) only). With a window the splits cut the window's keys instead of [0, seq_len), so tiles
before it are never read. Both 0 (the default) compile to the kernel without them.

NOTE: merging the splits in the same kernel (the last program to finish, found by an atomic ticket, merging its
head group) was measured slower than the separate reduce kernel: 1.34× the layer's attention at batch 1, 1.21× at
8 sequences. The ticket's barrier, release-acquire atomic and the merge's L2 loads sit on the critical path and cost
more than the launch they save.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from services.gpu_worker.attention.base import DEFAULT_ATTENTION, LayerAttention
from services.gpu_worker.kernels import paging, pdl, v_pairs
from services.gpu_worker.kv_cache import FP8_DTYPES, is_v_pairs

BLOCK_N = 64
MAX_SPLITS = 32
# (keys per tile, warps, pipeline stages, fp16 dots, register cap or 0, assembly unpacking) of the split kernel, by
# cache dtype; `tile=` overrides (bench/kernel_table.py --tile-sweep). fp16 dots: q, the widened K/V tiles and p go
# into the tensor cores as fp16 instead of q's dtype. e4m3 widens to fp16 exactly, one instruction per pair (to bf16
# it takes three more); a bf16 q is exact in fp16 from 2^-14 up, clamped at ±65504; p in [0, 1] keeps 3 more bits.
# An FP8 cache moves half the bytes per tile for about the same instructions, so its tile is twice as long: on the
# H200 at 384 sequences × 1504 keys, 32 layers, 64 keys took 16.4 ms, 128 keys 12.2 ms (copy speed: 9.0 ms).
# NOTE: below 5 stages the pipeliner gives the K/V copies one buffer (the page-table load takes a stage), so a
# program's copy of tile i+1 is waited for right after tile i's math; other programs on the SM hide that latency.
# 5 stages double-buffer them, but cost shared memory, hence programs per SM; they measured no faster at 384
# sequences. Widening V to 16 bits before its layout change was 30 % slower: Triton reads an 8-bit transposed
# operand from shared memory a byte at a time, and widened first it takes a round trip through shared memory.
# The sixth field, for an FP8 cache in key pairs with fp16 dots: unpack V's words with v_pairs._UNPACK_PTX instead
# of Triton's conversion (fewer instructions; on the GPU only: under the interpreter it falls back). On the H200 it
# took 32 layers at 384 sequences × 1504 keys from 11.06 to 10.75 ms, and 512 from 14.57 to 13.72.
# TILE_FP8_FEW: the FP8 tile with a 128-register cap, four programs per SM instead of three, for a launch of one
# split and at most FEW_PROGRAMS programs, where the last wave is a large share of the work. On the H200 the cap was
# faster at every batch measured, 64 to 512 sequences (at 384 × 1504 keys, 327 against 336 µs per layer); above 512
# sequences it has not been measured, hence the bound.
TILE = (BLOCK_N, 4, 2, False, 0, False)
TILE_FP8 = (128, 4, 2, True, 0, True)
TILE_FP8_FEW = (128, 4, 2, True, 128, True)
FEW_PROGRAMS = 4096


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton.jit does


def full_tile(tile: tuple) -> tuple[int, int, int, bool, int, bool]:
    """A tile of five fields (no assembly unpacking) or six, as six."""
    return tuple(tile) + (False,) * (6 - len(tile))


def default_tile(cache_dtype: torch.dtype, num_seqs: int, num_kv_heads: int, num_splits: int) -> tuple:
    """The split kernel's tile for a launch over a cache of this dtype: TILE, TILE_FP8, or TILE_FP8_FEW for an FP8
    launch of one split and at most FEW_PROGRAMS programs (the notes above TILE say why)."""
    if cache_dtype not in FP8_DTYPES:
        return TILE
    return TILE_FP8_FEW if num_splits == 1 and num_seqs * num_kv_heads <= FEW_PROGRAMS else TILE_FP8


def parse_tile(text: str) -> tuple[int, int, int, bool, int, bool]:
    """A tile from "keys,warps,stages,fp16_dots,max_regs[,asm_unpack]" (flags 0 or 1), as the benchmarks' flags
    give it."""
    fields = [int(x) for x in text.split(",")]
    if len(fields) not in (5, 6):
        raise ValueError(f"a tile is keys,warps,stages,fp16_dots,max_regs[,asm_unpack], not {text!r}")
    block_n, warps, stages, f16_dot, max_regs, asm = full_tile(fields)
    return block_n, warps, stages, bool(f16_dot), max_regs, bool(asm)


def tile_name(tile: tuple) -> str:
    """A short label of a tile for the benchmarks' records, e.g. 128x4w2s_f16dot_r128_asm."""
    block_n, warps, stages, f16_dot, max_regs, asm = full_tile(tile)
    return (f"{block_n}x{warps}w{stages}s" + ("_f16dot" if f16_dot else "") + (f"_r{max_regs}" if max_regs else "")
            + ("_asm" if asm else ""))


@triton.jit
def _rotate_row(x_ptrs, partner_ptrs, cos, sin, is_first_half, mask):
    """RoPE (rotate-half) of rows of D loaded whole: x1·cos − x2·sin | x2·cos + x1·sin, fp32.

    NOTE: written as rope._rotate's two expressions (selected, not merged) so the rounding is the same."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(is_first_half, x * cos - xp * sin, x * cos + xp * sin)


def spec_args(spec: LayerAttention, head_dim: int) -> tuple[float, dict]:
    """A layer's attention as the kernels take it: (sm_scale, {SOFTCAP, WINDOW} constexprs, 0 where off)."""
    scale = 1.0 / math.sqrt(head_dim) if spec.scale is None else spec.scale
    return scale, {"SOFTCAP": float(spec.softcap or 0.0), "WINDOW": int(spec.sliding_window or 0)}


@triton.jit
def soft_cap(x, SOFTCAP: tl.constexpr):
    """SOFTCAP · tanh(x) · log2(e), fp32: the capped logits in exp2's units, for x = logits / SOFTCAP. tanh through
    exp2 of -2|x| (no overflow; the interpreter has no libdevice tanh)."""
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    tanh_abs = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -tanh_abs, tanh_abs) * (SOFTCAP * 1.4426950408889634)


@triton.jit
def attend_one(q, k_row, v_row, qk_scale, valid, m_i, l_i, acc, P_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr):
    """The online softmax's update by one key (k_row, v_row [D]) if `valid`, on CUDA cores; p rounded to P_DTYPE
    as the loop's p is; qk_scale as the loop's (sm_scale / SOFTCAP with a soft-cap). Returns (m_i, l_i, acc)."""
    s = tl.sum(q.to(tl.float32) * k_row.to(tl.float32)[None, :], axis=1) * qk_scale  # [BLOCK_H]
    if SOFTCAP > 0:
        s = soft_cap(s, SOFTCAP)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty split without the key stays empty
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref)
    l_i = l_i * alpha + p
    p = p.to(P_DTYPE).to(tl.float32)
    return m_new, l_i, acc * alpha[:, None] + p[:, None] * v_row.to(tl.float32)[None, :]


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, vw_ptr, table_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
                   kn_ptr, vn_ptr, pos_ptr, inv_freq_ptr, slot_ptr,
                   sm_scale, stride_qb, stride_qh, stride_cs, stride_ch, stride_tb, stride_ob, stride_oh,
                   stride_knb, stride_knh, stride_vnb, stride_vnh,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, NEW_TOKEN: tl.constexpr,
                   F16_DOT: tl.constexpr, V_PAIRS: tl.constexpr, V_ASM: tl.constexpr, OFF64: tl.constexpr,
                   SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    pdl.wait(PDL)
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    if WINDOW:  # the splits cut [lo, seq_len) (from lo - 1 for an odd lo with V in pairs: an even start)
        lo = tl.maximum(seq_len - WINDOW, 0)  # the window's first key
        if V_PAIRS:
            base = lo - lo % 2
        else:
            base = lo
        chunk = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = base + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_h  # [BLOCK_H]
    h_mask = offs_h < GROUP
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh  # [BLOCK_H, 1]
    cache_end = seq_len
    if NEW_TOKEN:
        HALF = HEAD_DIM // 2
        partner = (offs_d + HALF) % HEAD_DIM
        is_first_half = offs_d < HALF
        freqs = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + offs_d % HALF)
        cos, sin = tl.cos(freqs), tl.sin(freqs)  # [D]: the angles of rope._cos_sin, per half
        q = _rotate_row(q_rows + offs_d[None, :], q_rows + partner[None, :], cos[None, :], sin[None, :],
                        is_first_half[None, :], h_mask[:, None]).to(q_ptr.dtype.element_ty)  # [BLOCK_H, D]
        kn_row = kn_ptr + b * stride_knb + kvh * stride_knh
        # rounded to k's dtype, then the cache's, as rope_kv_write_ stores it
        k_new = _rotate_row(kn_row + offs_d, kn_row + partner, cos, sin, is_first_half, offs_d < HEAD_DIM)
        k_new = k_new.to(kn_ptr.dtype.element_ty).to(k_ptr.dtype.element_ty)  # [D]
        v_new = tl.load(vn_ptr + b * stride_vnb + kvh * stride_vnh + offs_d).to(v_ptr.dtype.element_ty)  # [D]
        cache_end = seq_len - 1  # the new token's K/V come from registers, not the cache
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=h_mask[:, None], other=0.0)  # [BLOCK_H, D]
    if F16_DOT:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below
    if SOFTCAP > 0:  # soft_cap's tanh takes logits / SOFTCAP and gives log2 units
        qk_scale = sm_scale / SOFTCAP
    kv_end = tl.minimum(end, cache_end)
    dot_dtype: tl.constexpr = tl.float16 if F16_DOT else q_ptr.dtype.element_ty
    # V in key pairs: the loop stops at an even key, and an odd last key is attended to on its own below
    # (v_pairs.load_pairs says why); splits start at even keys (multiples of BLOCK_N, or after `base`)
    loop_end = kv_end - kv_end % 2 if V_PAIRS else kv_end
    for n0 in range(start, loop_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < loop_end
        if WINDOW:  # masks key lo - 1 alone: V in pairs, a first tile from base = lo - 1 (it shares lo's word)
            n_mask = n_mask & (offs_n >= lo)
        slot = paging.slot_of(table_ptr + b * stride_tb, offs_n, n_mask, PAGE_SIZE, OFF64)
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]  # [BLOCK_N, D]
        # NOTE: an FP8 cache is widened to q's dtype here (a no-op for a cache of q's dtype), or to fp16
        k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0).to(dot_dtype)
        if V_PAIRS:  # V's even and odd keys [BLOCK_N / 2, D] (v_pairs.py)
            v_lo, v_hi = v_pairs.unpack(v_pairs.load_pairs(vw_ptr, table_ptr + b * stride_tb, kvh * stride_ch, offs_d,
                                                           n0, loop_end, stride_cs, PAGE_SIZE, BLOCK_N // 2, OFF64),
                                        dot_dtype, V_ASM)
        else:
            v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0).to(dot_dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N] fp32, log2 units
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_PAIRS:
            pv = v_pairs.dot_pairs(p.to(dot_dtype), v_lo, v_hi, BLOCK_H, BLOCK_N // 2)
        else:
            pv = tl.dot(p.to(dot_dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if V_PAIRS:
        last = loop_end  # kv_end - 1 where kv_end is odd
        has_last = (kv_end % 2 == 1) & (last >= start)
        if WINDOW:
            has_last = has_last & (last >= lo)
        k_last, v_last = v_pairs.load_key(k_ptr, v_ptr, table_ptr + b * stride_tb, last, has_last, kvh * stride_ch,
                                          offs_d, stride_cs, PAGE_SIZE)
        m_i, l_i, acc = attend_one(q, k_last, v_last, qk_scale, has_last, m_i, l_i, acc, dot_dtype, SOFTCAP)
    if NEW_TOKEN:
        last = seq_len - 1
        owns = (start <= last) & (last < end)  # exactly one split of the sequence holds position seq_len - 1
        m_i, l_i, acc = attend_one(q, k_new, v_new, qk_scale, owns, m_i, l_i, acc, dot_dtype, SOFTCAP)
        new_slot = tl.load(slot_ptr + b).to(tl.int64)
        write = tl.where(owns, offs_d < HEAD_DIM, False)  # NOTE: not `tensor & scalar` (the interpreter's mask dtype)
        tl.store(k_ptr + new_slot * stride_cs + kvh * stride_ch + offs_d, k_new, mask=write)
        tl.store(v_ptr + v_pairs.v_offset(new_slot, kvh * stride_ch + offs_d, stride_cs, V_PAIRS), v_new, mask=write)
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        is_empty = l_i == 0.0
        part = acc / tl.where(is_empty, 1.0, l_i)[:, None]
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(tl.where(is_empty, 1.0, l_i)))
        row = (b * GROUP * num_kv_heads + heads) * NUM_SPLITS + split  # [BLOCK_H] in [B, H, S]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], part, mask=h_mask[:, None])
        tl.store(lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl.wait(PDL)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (b * num_heads + h) * NUM_SPLITS + offs_s  # [S]
    lse = tl.load(lse_ptr + row)
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits: exp2(-inf) = 0
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :])  # [S, D]
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def num_splits_for(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Enough splits for about two programs per multiprocessor; a power of two in [1, MAX_SPLITS]."""
    want = max(1, -(-2 * num_sms // max(1, num_seqs * num_kv_heads)))
    return min(MAX_SPLITS, 1 << (want - 1).bit_length())


def _launch(q, k_cache, v_cache, page_table, seq_lens, num_splits, out, new_token, tile, pairs, spec):
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:
        part = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part = lse = out
    k_new, v_new, positions, inv_freq, slots = new_token or (q, q, q, q, q)
    block_n, num_warps, num_stages, f16_dot, max_regs, asm = full_tile(
        tile or default_tile(k_cache.dtype, num_seqs, num_kv_heads, num_splits))
    pairs = is_v_pairs(v_cache.dtype) if pairs is None else pairs
    assert not pairs or (v_cache.dtype in FP8_DTYPES and page_size % 2 == 0)
    asm = asm and pairs and f16_dot and not _INTERPRET
    sm_scale, spec_constexprs = spec_args(spec, head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, v_cache.view(torch.int16) if pairs else v_cache, page_table, seq_lens, out, part, lse,
        k_new, v_new, positions, inv_freq, slots, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, NEW_TOKEN=new_token is not None, F16_DOT=f16_dot, V_PAIRS=pairs,
        V_ASM=asm, OFF64=paging.needs_off64(k_cache), **spec_constexprs, num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": max_regs} if max_regs else {}), **pdl.args(q.device))
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            **pdl.args(q.device))
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, num_splits: int, out: torch.Tensor | None = None,
                     tile: tuple | None = None, v_pairs: bool | None = None,
                     spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [P, S, KVH, D]; page_table: [B, max_pages] int32; seq_lens: [B] (≥ 1).

    Returns out [B, H, D]: softmax(q·Kᵀ/√D)·V over each sequence's keys [0, seq_len). tile: (keys per tile,
    warps, stages, fp16 dots, register cap or 0[, asm unpack]) of the split kernel; None: default_tile's.
    v_pairs: whether v_cache holds its keys in pairs (v_pairs.py); None: kv_cache.is_v_pairs.
    spec: the layer's scale (instead of 1/√D), soft-cap and sliding window (keys [seq_len - window, seq_len)).
    """
    return _launch(q, k_cache, v_cache, page_table, seq_lens, num_splits, out, None, tile, v_pairs, spec)


def decode_attention_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                          num_splits: int, out: torch.Tensor | None = None,
                          tile: tuple | None = None, v_pairs: bool | None = None,
                          spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
    """rope_kv_write_ then decode_attention in one kernel, for a decode step (the new token of sequence b sits
    at position positions[b] = seq_lens[b] - 1, slot slot_mapping[b]).

    q: [B, H, D], k, v: [B, KVH, D] un-rotated (read, not changed); inv_freq: [D/2] fp32. Writes the rotated k
    and v into the caches and returns out [B, H, D]. q is not rotated in place (rope_kv_write_ does that).
    tile, v_pairs, spec: as decode_attention's.
    """
    assert k.stride(2) == 1 and v.stride(2) == 1 and inv_freq.dtype == torch.float32
    return _launch(q, k_cache, v_cache, page_table, seq_lens, num_splits, out,
                   (k, v, positions, inv_freq, slot_mapping), tile, v_pairs, spec)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         seq_lens: torch.Tensor, spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
    """fp32 per-sequence softmax attention over the gathered pages (GQA by repeating KV heads). The caches hold
    rows: pass an FP8 V cache of key pairs through kv_cache.v_rows first."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        k, v = gather_ref(k_cache, v_cache, page_table[b], seq_len, q.shape[1])
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[b] = attend_ref(q[b][None], k, v, q_pos, spec)[0].to(q.dtype)
    return out


def gather_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor, seq_len: int,
               num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values [seq_len, H, D] fp32 from its pages (KV heads repeated for GQA)."""
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    pages = table_row[: -(-seq_len // page_size)].long()
    k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [L, KVH, D]
    v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    return (k.repeat_interleave(num_heads // num_kv_heads, dim=1),
            v.repeat_interleave(num_heads // num_kv_heads, dim=1))


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               spec: LayerAttention) -> torch.Tensor:
    """q: [n, H, D] at positions q_pos [n]; k, v: [L, H, D] fp32 → [n, H, D] fp32: each query over the keys
    0 ≤ j ≤ its position (and within spec's window), logits scaled and soft-capped as spec says."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if spec.scale is None else spec.scale
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    mask = key_pos <= q_pos[:, None]  # [n, L]
    if spec.sliding_window is not None:
        mask &= key_pos > q_pos[:, None] - spec.sliding_window
    probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)
