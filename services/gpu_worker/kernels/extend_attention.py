"""Prefill/extend attention: each sequence's new tokens attend causally to its whole paged KV (cached prefix
plus the new tokens, which the caller has already written into the cache), variable lengths in one launch.

    seq b:  |<---- cached prefix ---->|<-- q_len new -->|
            0                 seq_len - q_len        seq_len

Grid (cdiv(max_query_len, BLOCK_M), B, H): one program, BLOCK_M new tokens of one query head.

A layer's LayerAttention picks variants at compile time, as in decode_attention.py: SOFTCAP (logits soft-capped
before the softmax) and WINDOW (the query at position p sees keys (p - WINDOW, p]; a program's key loop starts at
its first query's window, so tiles before it are not read). Both 0 (the default) compile to the kernel without them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.attention.base import DEFAULT_ATTENTION, LayerAttention
from services.gpu_worker.kernels import paging, v_pairs
from services.gpu_worker.kernels.decode_attention import (
    attend_one,
    attend_ref,
    gather_ref,
    soft_cap,
    spec_args,
)
from services.gpu_worker.kv_cache import is_v_pairs


# The engine passes slices of its step's index tensors (query_start[n:], seq_lens[n:] after n leading decodes), which
# start at any 4-byte boundary; the kernel loads one value of each per program, so their alignment is not
# specialized on: one compile serves every n (bench/gpu_suite.py's jit_compiles saw up to 3 per run before)
@triton.jit(do_not_specialize_on_alignment=["qstart_ptr", "seq_lens_ptr"])
def _extend_kernel(q_ptr, k_ptr, v_ptr, vw_ptr, out_ptr, qstart_ptr, seq_lens_ptr, table_ptr, sm_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_tb,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_PAIRS: tl.constexpr, OFF64: tl.constexpr,
                   SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(qstart_ptr + b)
    q_len = tl.load(qstart_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # [BLOCK_M, D]
    q_pos = prefix + offs_m  # [BLOCK_M]
    end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    end = tl.where(m_block * BLOCK_M < q_len, end, 0)  # this block holds no query: no work
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if SOFTCAP > 0:  # soft_cap's tanh takes logits / SOFTCAP and gives log2 units
        qk_scale = sm_scale / SOFTCAP
    # V in key pairs: the loop stops at an even key, and an odd last key is attended to on its own below
    loop_end = end - end % 2 if V_PAIRS else end
    loop_start = 0
    if WINDOW:  # from the first key the block's first query sees (the key before it too, for an even start)
        lo = tl.maximum(prefix + m_block * BLOCK_M - WINDOW + 1, 0)
        if V_PAIRS:
            loop_start = lo - lo % 2
        else:
            loop_start = lo
    for n0 in range(loop_start, loop_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < loop_end
        if WINDOW:
            n_mask = n_mask & (offs_n >= lo)
        slot = paging.slot_of(table_ptr + b * stride_tb, offs_n, n_mask, PAGE_SIZE, OFF64)
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
        # NOTE: an FP8 cache is widened to q's dtype here (a no-op for a cache of q's dtype)
        k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0).to(q_ptr.dtype.element_ty)  # [BLOCK_N, D]
        if V_PAIRS:  # V's even and odd keys [BLOCK_N / 2, D] (v_pairs.py)
            v_lo, v_hi = v_pairs.unpack(v_pairs.load_pairs(vw_ptr, table_ptr + b * stride_tb, kvh * stride_ch, offs_d,
                                                           n0, loop_end, stride_cs, PAGE_SIZE, BLOCK_N // 2, OFF64),
                                        q_ptr.dtype.element_ty, False)
        else:
            v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0).to(q_ptr.dtype.element_ty)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded query rows see no key
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_PAIRS:
            pv = v_pairs.dot_pairs(p.to(q_ptr.dtype.element_ty), v_lo, v_hi, BLOCK_M, BLOCK_N // 2)
        else:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if V_PAIRS:
        last = loop_end  # end - 1 where end is odd
        has_last = end % 2 == 1
        k_last, v_last = v_pairs.load_key(k_ptr, v_ptr, table_ptr + b * stride_tb, last, has_last, kvh * stride_ch,
                                          offs_d, stride_cs, PAGE_SIZE)
        allowed = tl.where(has_last, last <= q_pos, False)  # [BLOCK_M], causal
        if WINDOW:
            allowed = allowed & (last > q_pos - WINDOW)
        m_i, l_i, acc = attend_one(q, k_last, v_last, qk_scale, allowed, m_i, l_i, acc, q_ptr.dtype.element_ty,
                                   SOFTCAP)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                     seq_lens: torch.Tensor, page_table: torch.Tensor, max_query_len: int,
                     block_m: int = 64, block_n: int = 64, out: torch.Tensor | None = None,
                     spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
    """q: [T, H, D]; caches [P, S, KVH, D] already holding the new K/V (an FP8 V in key pairs: kv_cache.py);
    query_start: [B+1]; seq_lens: [B]; page_table: [B, max_pages] → out [T, H, D]. spec: the layer's scale,
    soft-cap and sliding window.

    query_start holds row indices into q and out, so a batch's tail of sequences can be passed alone (views
    query_start[n:], seq_lens[n:], page_table[n:]) with the whole q and out: only those rows are written."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
    pairs = is_v_pairs(v_cache.dtype)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    sm_scale, spec_constexprs = spec_args(spec, head_dim)
    _extend_kernel[grid](
        q, k_cache, v_cache, v_cache.view(torch.int16) if pairs else v_cache, out, query_start, seq_lens, page_table,
        sm_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, V_PAIRS=pairs, OFF64=paging.needs_off64(k_cache), **spec_constexprs,
        num_warps=4, num_stages=2)
    return out


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                         seq_lens: torch.Tensor, page_table: torch.Tensor,
                         spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
    """fp32 causal attention per sequence over its gathered pages, of caches of rows (kv_cache.v_rows)."""
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        start, end, seq_len = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b])
        k, v = gather_ref(k_cache, v_cache, page_table[b], seq_len, q.shape[1])
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        out[start:end] = attend_ref(q[start:end], k, v, q_pos, spec).to(q.dtype)
    return out
