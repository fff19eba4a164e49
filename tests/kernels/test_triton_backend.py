"""The Triton attention backend on whole steps (decode-only and mixed decode + prefill) vs the torch reference
backend after rope_ref: the same outputs, the same KV cache."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.base import AttentionMetadata, LayerAttention
from services.gpu_worker.attention.torch_ref import TorchAttention
from services.gpu_worker.attention.triton_backend import TritonAttention
from services.gpu_worker.kernels.rope import rope_ref
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.rope import inv_frequencies
from tests.kernels.helpers import DEVICE, randn, rel_err

PAGE = 4


def _step(new_and_cached: list[tuple[int, int]], num_heads=4, num_kv_heads=2, head_dim=16, seed=0):
    """A step over sequences given as (new tokens, tokens already cached): a random cache, each sequence on
    its own pages, the step's un-rotated q/k/v and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [new + cached for new, cached in new_and_cached]
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    cache = KVCache(1, 1 + sum(pages_per_seq), PAGE, num_kv_heads, head_dim, torch.float32, DEVICE)
    cache.k.copy_(randn(cache.k.shape, gen, torch.float32, DEVICE))
    cache.v.copy_(randn(cache.v.shape, gen, torch.float32, DEVICE))
    table = torch.zeros((len(seq_lens), max(pages_per_seq)), dtype=torch.int32)
    first, slots, positions, starts = 1, [], [], [0]
    for i, ((new, cached), pages) in enumerate(zip(new_and_cached, pages_per_seq)):
        table[i, :pages] = torch.arange(first, first + pages)
        for pos in range(cached, cached + new):
            slots.append(int(table[i, pos // PAGE]) * PAGE + pos % PAGE)
            positions.append(pos)
        first += pages
        starts.append(starts[-1] + new)
    num_tokens = starts[-1]
    qkv = randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), gen, torch.float32, DEVICE)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), page_table=table.to(DEVICE),
        query_start_host=starts, seq_lens_host=seq_lens, max_query_len=max(n for n, _ in new_and_cached),
        max_seq_len=max(seq_lens))
    inv_freq = inv_frequencies(head_dim, 10000.0, None).to(DEVICE)
    return q, k, v, torch.tensor(positions, device=DEVICE), inv_freq, cache, meta


@pytest.mark.parametrize("fuse_decode,mixed_to_decode", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("new_and_cached", [
    [(1, 8), (1, 0), (5, 7), (3, 0)],  # decodes first, then prefill chunks (with and without a cached prefix)
    [(1, 20), (1, 3)],  # decode-only
    [(6, 2), (1, 9)],  # a chunk first: only a leading run of one-token sequences takes the decode kernel
], ids=["mixed", "decode_only", "chunk_first"])
def test_forward_rope_equals_the_reference(new_and_cached, fuse_decode, mixed_to_decode):
    q, k, v, positions, inv_freq, cache, meta = _step(new_and_cached)
    ref_cache = KVCache(1, cache.num_pages, PAGE, cache.k.shape[3], cache.k.shape[4], torch.float32, DEVICE)
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    ref = TorchAttention().forward(0, ref_q, ref_k, v, ref_cache, meta)

    backend = TritonAttention(num_sms=4, fuse_decode=fuse_decode, mixed_decodes_to_decode_kernel=mixed_to_decode)
    out = backend.forward_rope(0, q, k, v, positions, inv_freq, cache, meta)
    assert rel_err(out, ref) < 2e-3
    assert rel_err(cache.k, ref_cache.k) < 1e-5 and torch.equal(cache.v, ref_cache.v)


GEMMA_LIKE = {
    "local": LayerAttention(scale=0.3, softcap=1.5, sliding_window=5),  # a window of about one page
    "global": LayerAttention(scale=0.3, softcap=1.5),
    "window_only": LayerAttention(sliding_window=9),
}


@pytest.mark.parametrize("fused", [True, False], ids=["forward_rope", "forward"])
@pytest.mark.parametrize("name", list(GEMMA_LIKE))
@pytest.mark.parametrize("new_and_cached", [
    [(1, 8), (1, 0), (5, 7), (3, 0), (1, 13)],  # mixed: decodes first, chunks, a decode among the chunks
    [(1, 20), (1, 3), (1, 6)],  # decode-only
], ids=["mixed", "decode_only"])
def test_layer_attention_equals_the_reference(new_and_cached, name, fused):
    """A layer's scale, soft-cap and window through forward() (the Gemma 2 path: RoPE applied by the model) and
    forward_rope(), decode-only and mixed steps: the torch backend's outputs and cache."""
    spec = GEMMA_LIKE[name]
    q, k, v, positions, inv_freq, cache, meta = _step(new_and_cached, seed=1)
    q = q * 2  # logits of a few units: the cap bends them
    ref_cache = KVCache(1, cache.num_pages, PAGE, cache.k.shape[3], cache.k.shape[4], torch.float32, DEVICE)
    ref_cache.k.copy_(cache.k)
    ref_cache.v.copy_(cache.v)
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    ref = TorchAttention().forward(0, ref_q, ref_k, v, ref_cache, meta, spec)
    plain = TorchAttention().forward(0, ref_q, ref_k, v, ref_cache, meta)
    backend = TritonAttention(num_sms=4)
    if fused:
        out = backend.forward_rope(0, q, k, v, positions, inv_freq, cache, meta, spec)
    else:
        out = backend.forward(0, ref_q, ref_k, v, cache, meta, spec)
    assert rel_err(out, ref) < 1e-4 and rel_err(plain, ref) > 0.05
    assert rel_err(cache.k, ref_cache.k) < 1e-5 and torch.equal(cache.v, ref_cache.v)


def test_leading_single_token_sequences_are_counted_once_per_step():
    *_, meta = _step([(1, 8), (1, 0), (5, 7), (1, 3)])
    assert meta.num_leading_single == 2
    *_, meta = _step([(2, 1), (1, 1)])
    assert meta.num_leading_single == 0


@pytest.mark.parametrize("mixed_to_decode", [True, False])
def test_mixed_step_sends_its_decodes_to_the_decode_kernel_when_asked(monkeypatch, mixed_to_decode):
    """With the option the extend kernel sees only the prefill chunks and the decode kernel the leading
    decodes; without it (the default) the extend kernel takes the whole mixed step."""
    from services.gpu_worker.attention import triton_backend

    calls: dict[str, list[int]] = {"decode": [], "extend": []}
    real_decode, real_extend = triton_backend.decode_attention_rope, triton_backend.extend_attention

    def decode(q, *args, **kwargs):
        calls["decode"].append(q.shape[0])
        return real_decode(q, *args, **kwargs)

    def extend(q, k_cache, v_cache, query_start, seq_lens, *args, **kwargs):
        calls["extend"].append(seq_lens.shape[0])
        return real_extend(q, k_cache, v_cache, query_start, seq_lens, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention_rope", decode)
    monkeypatch.setattr(triton_backend, "extend_attention", extend)
    q, k, v, positions, inv_freq, cache, meta = _step([(1, 8), (1, 0), (1, 5), (5, 7), (3, 0)])
    backend = TritonAttention(num_sms=4, mixed_decodes_to_decode_kernel=mixed_to_decode)
    backend.forward_rope(0, q, k, v, positions, inv_freq, cache, meta)
    assert calls == ({"decode": [3], "extend": [2]} if mixed_to_decode else {"decode": [], "extend": [5]})
