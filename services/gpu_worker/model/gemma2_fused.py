"""The CUDA forward of Gemma 2 (gemma2.py's blocks): fused q/k/v and gate/up projections around Triton kernels,
the same function as the torch forward up to bf16 rounding.

Per layer: the attention of model/fused.py (fused q/k/v; RoPE in the KV write; the layer's scale, soft-cap and
window through its LayerAttention), GELU(tanh)·mul on the fused gate/up output (kernels/silu_mul.py), and the four
(1 + w) norms in two launches (kernels/gemma_norm.py): the post-attention norm, its residual add and the
pre-feedforward norm in one; the post-feedforward norm, its residual add and the next layer's input norm (the final
norm after the last layer) in the other. o_proj and down_proj are not split-K here (the post-norm comes first)."""
from __future__ import annotations

import math

import torch
from torch import nn

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.kernels.embedding import embedding_fed
from services.gpu_worker.kernels.gemma_norm import gemma_post_norm_add, gemma_rms_norm
from services.gpu_worker.kernels.silu_mul import silu_mul
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.fused import _attention, _column_projection, _row_projection


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
            meta: AttentionMetadata, backend: AttentionBackend,
            fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """input_ids, positions: [T] → hidden [T, hidden] after the final norm (as fused.forward)."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    table = model.model.embed_tokens.weight
    h = table[input_ids] if fed is None else embedding_fed(table, input_ids, fed[0], fed[1])
    residual = h * torch.tensor(math.sqrt(cfg.hidden_size), dtype=h.dtype)  # gemma2.embed's scale
    layers = model.model.layers
    gemv = 0 < input_ids.shape[0] <= model.gemv_max_tokens
    x = gemma_rms_norm(residual, layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(layers):
        attn = _attention(layer.self_attn, x, positions, model.inv_freq, cache, meta, backend, 1, gemv)
        x, residual = gemma_post_norm_add(attn, layer.post_attention_layernorm.weight, residual,
                                          layer.pre_feedforward_layernorm.weight, eps)
        gate_up = _column_projection(x, layer.mlp.gate_up_weight, None, gemv)  # [T, 2 I]
        mlp = _row_projection(silu_mul(gate_up, gelu=True), layer.mlp.down_proj, 1, gemv)
        following = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
        x, residual = gemma_post_norm_add(mlp, layer.post_feedforward_layernorm.weight, residual, following, eps)
    return x
