"""Paged decode attention (split-K, GQA) vs its fp32 torch reference; the RoPE + KV-write
fused variant vs rope_ref, kv_write_ref and that reference."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.decode_attention import (
    decode_attention,
    decode_attention_ref,
    decode_attention_rope,
    num_splits_for,
)
from services.gpu_worker.kernels.kv_write import kv_write_ref
from services.gpu_worker.kernels.rope import rope_ref
from services.gpu_worker.model.presets import preset
from services.gpu_worker.model.rope import inv_frequencies
from tests.kernels.helpers import DEVICE, gpu_only, randn, random_paged_cache, rel_err


def _check(seq_lens, num_heads, num_kv_heads, head_dim, page_size, num_splits, dtype, tol, device=DEVICE):
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_splits)
    k_cache, v_cache, table, lens = random_paged_cache(seq_lens, page_size, num_kv_heads, head_dim, dtype,
                                                       device, gen)
    q = randn((len(seq_lens), num_heads, head_dim), gen, dtype, device)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, table, lens, num_splits, out=out)
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("seq_lens", [[1, 5, 37], [130]])
def test_decode_small(seq_lens, num_splits):
    _check(seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_splits=num_splits,
           dtype=torch.float32, tol=2e-3)


def test_decode_more_splits_than_keys():
    _check([3, 70], num_heads=2, num_kv_heads=1, head_dim=16, page_size=16, num_splits=8,
           dtype=torch.float32, tol=2e-3)


def test_num_splits_fills_the_chip():
    assert num_splits_for(1, 8, 132) == 32
    assert num_splits_for(128, 8, 132) == 1
    assert num_splits_for(16, 8, 132) == 4


def _new_token_step(seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, seed):
    """A decode step's inputs: caches holding seq_len - 1 tokens of each sequence, the new token's
    un-rotated q/k/v (views of one fused projection, as the model passes them), its position and slot."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table, lens = random_paged_cache(seq_lens, page_size, num_kv_heads, head_dim, dtype,
                                                       DEVICE, gen)
    qkv = randn((len(seq_lens), num_heads + 2 * num_kv_heads, head_dim), gen, dtype, DEVICE)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    positions = lens.long() - 1
    slots = (table.long().gather(1, (positions // page_size)[:, None])[:, 0] * page_size + positions % page_size)
    inv_freq = inv_frequencies(head_dim, 500000.0, preset("llama3-8b").rope_scaling).to(DEVICE)
    return q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens


def _check_rope(seq_lens, num_heads, num_kv_heads, head_dim, page_size, num_splits, dtype, tol):
    q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens = _new_token_step(
        seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, sum(seq_lens) + num_splits)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    kv_write_ref(ref_k, v, ref_k_cache, ref_v_cache, slots)
    ref = decode_attention_ref(ref_q, ref_k_cache, ref_v_cache, table, lens)
    q_before, k_before = q.clone(), k.clone()
    out = torch.full_like(q, float("nan"))
    decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots.to(torch.int32), table, lens,
                          num_splits, out=out)
    assert rel_err(out, ref) < tol
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # read, not rotated in place
    assert torch.equal(v_cache, ref_v_cache)  # the new v in its slot, every other slot untouched
    assert rel_err(k_cache, ref_k_cache) < tol / 10
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[untouched], ref_k_cache.view(-1, num_kv_heads, head_dim)[untouched])
    return out


@pytest.mark.parametrize("num_splits", [1, 4, 8])
@pytest.mark.parametrize("seq_lens", [[1, 5, 37], [130], [16, 17]])
def test_decode_rope_small(seq_lens, num_splits):
    _check_rope(seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_splits=num_splits,
                dtype=torch.float32, tol=2e-3)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("seq_lens", [[1], [17, 512, 1000, 3], [4096] * 8, list(range(1, 2000, 61))])
@pytest.mark.parametrize("num_splits", [1, 8, 32])
@pytest.mark.parametrize("check", [_check, _check_rope], ids=["plain", "rope_fused"])
def test_decode_llama8b_shapes(check, seq_lens, num_splits):
    check(seq_lens, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, num_splits=num_splits,
          dtype=torch.bfloat16, tol=1e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_splits", [1, 32])
def test_decode_rope_same_cache_bits_as_rope_kv_write(num_splits):
    """On the device the fused kernel stores exactly what rope_kv_write_ stores, and attends like
    rope_kv_write_ + decode_attention (up to the new token's score, summed in another order)."""
    from services.gpu_worker.kernels.rope_kv_write import rope_kv_write_

    q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens = _new_token_step(
        [1, 33, 700, 2048], 32, 8, 128, 16, torch.bfloat16, 11)
    k2, v2, q2 = k_cache.clone(), v_cache.clone(), q.clone()
    out = decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens, num_splits)
    rope_kv_write_(q2, k, v, positions, inv_freq, k2, v2, slots)
    unfused = decode_attention(q2, k2, v2, table, lens, num_splits)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert rel_err(out, unfused) < 1e-2
