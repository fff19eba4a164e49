"""The Triton attention backend of the CUDA path: KV write, split-K paged decode, paged extend/prefill; a layer's
LayerAttention (scale, soft-cap, sliding window) goes to the kernels, which compile a variant for it."""
from __future__ import annotations

import torch

from services.gpu_worker.attention.base import DEFAULT_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention
from services.gpu_worker.kernels.decode_attention import decode_attention, decode_attention_rope, num_splits_for
from services.gpu_worker.kernels.extend_attention import extend_attention
from services.gpu_worker.kernels.kv_write import kv_write
from services.gpu_worker.kernels.rope_kv_write import rope_kv_write_
from services.gpu_worker.kv_cache import KVCache


class TritonAttention(AttentionBackend):
    """Decode-only steps run the split-K decode kernel (with RoPE and the KV write inside it, on the fused
    model path); steps with a prefill chunk run RoPE + KV write, then the extend kernel for every sequence
    (or, with mixed_decodes_to_decode_kernel, the extend kernel for the chunks and the decode kernel for the
    decodes in front of them).

    NOTE: the decode split count depends on the batch size alone (never on host-side lengths), so a
    captured CUDA graph stays valid for every sequence length.
    """

    name = "triton"

    def __init__(self, num_sms: int | None = None, fuse_decode: bool = True,
                 mixed_decodes_to_decode_kernel: bool = True) -> None:
        # False: rope_kv_write_ then the decode kernel, as before decode_attention_rope (benchmarks compare both)
        self.fuse_decode = fuse_decode
        # On by default: a mixed step's one-token decodes go to the decode kernel, not the extend kernel; on the
        # H200 that raised W1's output throughput by 3 % (docs/PERFORMANCE.md, levers tried)
        self.mixed_decodes_to_decode_kernel = mixed_decodes_to_decode_kernel
        self.num_sms = num_sms or (torch.cuda.get_device_properties(0).multi_processor_count
                                   if torch.cuda.is_available() else 1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata, spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
        k_cache, v_cache = cache.k[layer], cache.v[layer]  # [P, S, KVH, D]
        kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, spec)

    def forward_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                     spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
        """forward() for un-rotated q and k. The leading sequences with one new token (decodes come first) run
        the split-K decode kernel with RoPE and the KV write inside it, when the step is decode-only or
        mixed_decodes_to_decode_kernel is set; the rest run RoPE + KV write in one kernel (rope_kv_write.py),
        then the extend kernel.

        Why send a mixed step's decodes to the decode kernel: the extend kernel runs one query head per
        program, so it reads each decode's KV once per head of its group."""
        k_cache, v_cache = cache.k[layer], cache.v[layer]  # [P, S, KVH, D]
        n = 0  # the leading sequences that take the decode kernel
        if self.fuse_decode and meta.is_decode_only:
            n = meta.num_seqs
        elif self.fuse_decode and self.mixed_decodes_to_decode_kernel:
            n = meta.num_leading_single
        if n == 0:
            rope_kv_write_(q, k, v, positions, inv_freq, k_cache, v_cache, meta.slot_mapping)
            return self._attend(q, k_cache, v_cache, meta, spec)
        out = torch.empty_like(q)
        num_splits = num_splits_for(n, k_cache.shape[2], self.num_sms)
        decode_attention_rope(q[:n], k[:n], v[:n], positions[:n], inv_freq, k_cache, v_cache, meta.slot_mapping[:n],
                              meta.page_table[:n], meta.seq_lens[:n], num_splits, out=out[:n], spec=spec)
        if n < meta.num_seqs:
            rope_kv_write_(q[n:], k[n:], v[n:], positions[n:], inv_freq, k_cache, v_cache, meta.slot_mapping[n:])
            extend_attention(q, k_cache, v_cache, meta.query_start[n:], meta.seq_lens[n:], meta.page_table[n:],
                             meta.max_query_len, out=out, spec=spec)
        return out

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, spec: LayerAttention) -> torch.Tensor:
        if meta.is_decode_only:
            num_splits = num_splits_for(q.shape[0], k_cache.shape[2], self.num_sms)
            return decode_attention(q, k_cache, v_cache, meta.page_table, meta.seq_lens, num_splits, spec=spec)
        return extend_attention(q, k_cache, v_cache, meta.query_start, meta.seq_lens, meta.page_table,
                                meta.max_query_len, spec=spec)
