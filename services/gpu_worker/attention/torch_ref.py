"""The torch reference attention over the paged KV cache: correct on any device, the CPU path.

A cache of another dtype than q's (FP8) is converted to q's dtype as it is gathered (an FP8 V cache's key pairs
back to rows: kv_cache.py). A layer's LayerAttention (scale, soft-cap, sliding window: Gemma 2) is applied here;
a soft-capped layer runs the softmax in plain torch (SDPA has no soft-cap), with transformers' eager arithmetic."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.gpu_worker.attention.base import DEFAULT_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention
from services.gpu_worker.kv_cache import KVCache, raw, v_rows


class TorchAttention(AttentionBackend):
    """Gathers each sequence's pages and runs SDPA; decode-only steps run as one padded batch."""

    name = "torch"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata, spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
        cache.write(layer, meta.slot_mapping, k, v)
        if meta.is_decode_only:
            return self._decode(layer, q, cache, meta, spec)
        return self._extend(layer, q, cache, meta, spec)

    def _decode(self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                spec: LayerAttention) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_pages = -(-meta.max_seq_len // cache.page_size)
        pages = meta.page_table[:, :num_pages].long()  # [B, P]
        k = _gather(cache.k[layer], pages, num_heads, q.dtype)  # [B, H, P*S, D]
        v = _gather(cache.v[layer], pages, num_heads, q.dtype, is_v=True)
        key_pos = torch.arange(k.shape[2], device=q.device)
        mask = _visible(key_pos[None, :], meta.seq_lens[:, None] - 1, spec)  # [B, P*S]
        out = _attend(q[:, :, None, :].to(k.dtype), k, v, mask[:, None, None, :], spec)  # [B, H, 1, D]
        return out[:, :, 0, :].to(q.dtype)

    def _extend(self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                spec: LayerAttention) -> torch.Tensor:
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
            mask = _visible(torch.arange(seq_len, device=q.device)[None, :], q_pos[:, None], spec)  # [n, L]
            qi = q[start:end].transpose(0, 1)[None].to(k.dtype)  # [1, H, n, D]
            oi = _attend(qi, k, v, mask[None, None], spec)
            out[start:end] = oi[0].transpose(0, 1).to(q.dtype)
        return out


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, spec: LayerAttention) -> torch.Tensor:
    """Which keys each query attends to (broadcast): key_pos ≤ query_pos, within the layer's window if any."""
    mask = key_pos <= query_pos
    if spec.sliding_window is not None:
        mask &= key_pos > query_pos - spec.sliding_window
    return mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            spec: LayerAttention) -> torch.Tensor:
    """q: [B, H, n, D]; k, v: [B, H, L, D]; mask: bool, broadcast to [B, H, n, L] → [B, H, n, D]."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale)
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    logits = torch.tanh(q @ k.transpose(-1, -2) * scale / spec.softcap) * spec.softcap  # [B, H, n, L]
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype) @ v


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
