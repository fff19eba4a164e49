"""Paged decode attention (one new query token per sequence), GQA-aware and split-K (flash-decoding).

Grid (B, KVH, NUM_SPLITS): one program holds all GROUP = H / KVH query heads of one KV head, so each K/V
tile is read once for the whole group. A sequence's keys [0, seq_len) are cut into NUM_SPLITS chunks at run
time (from seq_lens on the device), which keeps the grid fixed for a CUDA graph; a second kernel merges the
chunks' partial outputs by their log-sum-exp. With NUM_SPLITS == 1 the first kernel writes the output itself.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64
MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
                         sm_scale, stride_qb, stride_qh, stride_cs, stride_ch, stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_h  # [BLOCK_H]
    h_mask = offs_h < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0)  # [BLOCK_H, D]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 below
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(table_ptr + b * stride_tb + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]  # [BLOCK_N, D]
        k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_H, BLOCK_N] fp32, log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        is_empty = l_i == 0.0
        out = acc / tl.where(is_empty, 1.0, l_i)[:, None]
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(tl.where(is_empty, 1.0, l_i)))
        row = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_H] in [B, H, S]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_mask[:, None])
        tl.store(lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, num_splits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [P, S, KVH, D]; page_table: [B, max_pages] int32; seq_lens: [B] (≥ 1).

    Returns out [B, H, D]: softmax(q·Kᵀ/√D)·V over each sequence's keys [0, seq_len).
    """
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
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, out, part, lse, 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        out.stride(0), out.stride(1), GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits, num_warps=4, num_stages=2)
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         seq_lens: torch.Tensor) -> torch.Tensor:
    """fp32 per-sequence softmax attention over the gathered pages (GQA by repeating KV heads)."""
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    for b in range(num_seqs):
        seq_len = int(seq_lens[b])
        pages = page_table[b, : -(-seq_len // page_size)].long()
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [L, KVH, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) / math.sqrt(head_dim)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
