"""The torch reference attention over the paged KV cache: correct on any device, the CPU path.

A cache of another dtype than q's (FP8) is converted to q's dtype as it is gathered (an FP8 V cache's key pairs
back to rows: kv_cache.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.kv_cache import KVCache, raw, v_rows


class TorchAttention(AttentionBackend):
    """Gathers each sequence's pages and runs SDPA; decode-only steps run as one padded batch."""

    name = "torch"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cache.write(layer, meta.slot_mapping, k, v)
        if meta.is_decode_only:
            return self._decode(layer, q, cache, meta)
        return self._extend(layer, q, cache, meta)

    def _decode(self, layer: int, q: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_pages = -(-meta.max_seq_len // cache.page_size)
        pages = meta.page_table[:, :num_pages].long()  # [B, P]
        k = _gather(cache.k[layer], pages, num_heads, q.dtype)  # [B, H, P*S, D]
        v = _gather(cache.v[layer], pages, num_heads, q.dtype, is_v=True)
        key_pos = torch.arange(k.shape[2], device=q.device)
        mask = key_pos[None, :] < meta.seq_lens[:, None]  # [B, P*S]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :].to(k.dtype), k, v, attn_mask=mask[:, None, None, :])  # [B, H, 1, D]
        return out[:, :, 0, :].to(q.dtype)

    def _extend(self, layer: int, q: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        num_heads = q.shape[1]
        for i in range(meta.num_seqs):
            start, end = meta.query_start_host[i], meta.query_start_host[i + 1]
            seq_len = meta.seq_lens_host[i]
            num_pages = -(-seq_len // cache.page_size)
            pages = meta.page_table[i : i + 1, :num_pages].long()  # [1, P]
            k = _gather(cache.k[layer], pages, num_heads, q.dtype)[:, :, :seq_len]  # [1, H, L, D]
            v = _gather(cache.v[layer], pages, num_heads, q.dtype, is_v=True)[:, :, :seq_len]
            num_new = end - start
            q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
            qi = q[start:end].transpose(0, 1)[None].to(k.dtype)  # [1, H, n, D]
            oi = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask[None, None])
            out[start:end] = oi[0].transpose(0, 1).to(q.dtype)
        return out


def _gather(pages_kv: torch.Tensor, pages: torch.Tensor, num_heads: int, dtype: torch.dtype,
            is_v: bool = False) -> torch.Tensor:
    """pages_kv: [P_all, S, KVH, D], pages: [B, P] → [B, H, P*S, D] in dtype, KV heads repeated for GQA."""
    num_seqs, num_pages = pages.shape
    _, page_size, num_kv_heads, head_dim = pages_kv.shape
    kv = raw(pages_kv)[pages].view(pages_kv.dtype)
    kv = (v_rows(kv) if is_v else kv).to(dtype)
    kv = kv.reshape(num_seqs, num_pages * page_size, num_kv_heads, head_dim)
    kv = kv.transpose(1, 2)  # [B, KVH, L, D]
    return kv.repeat_interleave(num_heads // num_kv_heads, dim=1)
