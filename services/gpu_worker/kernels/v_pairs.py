"""The FP8 V cache's key-pair layout, for the Triton kernels: where a V byte lies, and how 16-bit words of two
keys become the two halves of a P·V product's operand.

An FP8 V page stores its keys in pairs (kv_cache.py says why): rows 2j and 2j + 1 are interleaved byte by byte,
so with stride_cs = KVH · D the byte of (slot, kv head, d) lies at

    (slot - slot % 2) · stride_cs  +  2 · (kvh · D + d)  +  slot % 2

and the cache read as int16 holds, at (slot // 2) · stride_cs + kvh · D + d, keys 2j (low byte) and 2j + 1 (high
byte) of one d. A P·V product then splits P's columns into even and odd keys and multiplies each half by one byte
of the words, which load with 16-bit transposed shared-memory reads (LDSM.MT); an 8-bit V [keys, D] takes one
shared-memory read per byte instead (LDS.U8 in the compiled sm_90 code).
"""
from __future__ import annotations

import triton
import triton.language as tl

from services.gpu_worker.kernels import paging

# e4m3 pairs → fp16 pairs: one byte permute and two conversions per two words (Triton's own conversion takes
# shifts and masks to split a word first). Output element i is the low (even) or high (odd) key of word i.
_UNPACK_PTX = tl.constexpr("{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
                           "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@triton.jit
def v_offset(slot, head_off, stride_cs, PAIRS: tl.constexpr):
    """The offset of V's element (slot, head_off = kvh · D + d) in a cache of rows or of key pairs."""
    if PAIRS:
        off = (slot - slot % 2) * stride_cs + 2 * head_off + slot % 2
    else:
        off = slot * stride_cs + head_off
    return off


@triton.jit
def load_pairs(words_ptr, table_row_ptr, kvh_off, offs_d, n0, end, stride_cs,
               PAGE_SIZE: tl.constexpr, HALF_N: tl.constexpr, OFF64: tl.constexpr):
    """The words [HALF_N, D] of keys n0 + 2r and n0 + 2r + 1 (r < HALF_N), 0 from `end` on. `end` must be even:
    the slot after an odd end shares its word and may hold a stale byte, even a NaN (0 · NaN is NaN), so a
    kernel attends to an odd last key on its own (masking here costs a layout change through shared memory)."""
    offs_r = n0 + 2 * tl.arange(0, HALF_N)  # the even keys
    r_mask = offs_r < end
    row = paging.slot_of(table_row_ptr, offs_r, r_mask, PAGE_SIZE, OFF64) // 2  # the pair row of both keys
    return tl.load(words_ptr + row[:, None] * stride_cs + kvh_off + offs_d[None, :], mask=r_mask[:, None], other=0)


@triton.jit
def load_key(k_ptr, v_ptr, table_row_ptr, key, valid, kvh_off, offs_d, stride_cs, PAGE_SIZE: tl.constexpr):
    """K's and V's rows [D] of one key (V in pairs), or 0 where not `valid` (a scalar): the odd last key that
    load_pairs leaves out."""
    row_mask = tl.where(valid, offs_d >= 0, False)  # NOTE: not `tensor & scalar` (the interpreter's mask dtype)
    slot = paging.slot_of(table_row_ptr, key, valid, PAGE_SIZE, True)
    k_row = tl.load(k_ptr + slot * stride_cs + kvh_off + offs_d, mask=row_mask, other=0.0)
    v_row = tl.load(v_ptr + v_offset(slot, kvh_off + offs_d, stride_cs, True), mask=row_mask, other=0.0)
    return k_row, v_row


@triton.jit
def unpack(words, dtype: tl.constexpr, ASM: tl.constexpr):
    """int16 words of two e4m3 keys → (even keys, odd keys) in dtype; ASM (fp16 only, on the GPU): _UNPACK_PTX."""
    if ASM:
        tl.static_assert(dtype == tl.float16, "the unpacking assembly gives fp16")
        lo, hi = tl.inline_asm_elementwise(_UNPACK_PTX, "=r,=r,r", [words], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=2)
    else:
        lo = words.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
        hi = (words >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dtype)
    return lo, hi


@triton.jit
def dot_pairs(p, lo, hi, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr):
    """p [BLOCK_M, 2 · HALF_N] (in lo's dtype) · V, with V's even keys `lo` and odd keys `hi` [HALF_N, D]; fp32."""
    p_even, p_odd = tl.split(tl.reshape(p, (BLOCK_M, HALF_N, 2)))
    return tl.dot(p_even, lo) + tl.dot(p_odd, hi)
