"""The CUDA forward of LlamaForCausalLM: fused q/k/v and gate/up projections (cuBLAS) around the Triton
RMSNorm(+residual), RoPE(+KV write) and SiLU·mul kernels. Same function as the torch forward, up to bf16 rounding.

Under tensor parallelism (model.tp set) the projections hold this rank's heads and MLP share, and the
o_proj and down_proj outputs are summed over the ranks before the next RMSNorm+residual."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.kernels.rms_norm import rms_norm
from services.gpu_worker.kernels.rope import rope_
from services.gpu_worker.kernels.silu_mul import silu_mul
from services.gpu_worker.kv_cache import KVCache

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup


def fuse_projections(model: nn.Module) -> None:
    """Concatenate q/k/v (and gate/up) weights into one matrix each; the original parameters become views
    of it, so no memory is doubled and the HF parameter names still address the same numbers."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        attn.qkv_weight = _concat(qkv, "weight")  # [(H + 2 KVH) * D, hidden]
        attn.qkv_bias = _concat(qkv, "bias") if attn.q_proj.bias is not None else None
        mlp.gate_up_weight = _concat((mlp.gate_proj, mlp.up_proj), "weight")  # [2 I, hidden]


def _concat(linears: tuple[nn.Linear, ...], name: str) -> torch.Tensor:
    fused = torch.cat([getattr(lin, name).data for lin in linears])
    offset = 0
    for lin in linears:
        param = getattr(lin, name)
        rows = param.shape[0]
        param.data = fused[offset: offset + rows]
        offset += rows
    return fused


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
            meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
    """input_ids, positions: [T] int32/int64 → hidden [T, hidden] after the final norm."""
    eps = model.config.rms_norm_eps
    h = model.model.embed_tokens(input_ids)  # [T, hidden]
    residual = None
    for layer in model.model.layers:
        x, residual = rms_norm(h, layer.input_layernorm.weight, eps, residual)
        h = _attention(layer.self_attn, x, positions, model.inv_freq, cache, meta, backend)
        x, residual = rms_norm(h, layer.post_attention_layernorm.weight, eps, residual)
        gate_up = F.linear(x, layer.mlp.gate_up_weight)  # [T, 2 I] (I: this rank's share under TP)
        h = _reduce(F.linear(silu_mul(gate_up), layer.mlp.down_proj.weight), layer.mlp.tp)  # [T, hidden]
    out, _ = rms_norm(h, model.model.norm.weight, eps, residual)
    return out


def _attention(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
    num_tokens = x.shape[0]
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = F.linear(x, attn.qkv_weight, attn.qkv_bias).view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    q = qkv[:, :num_heads]  # [T, H, D] views
    k = qkv[:, num_heads: num_heads + num_kv_heads]  # [T, KVH, D]
    v = qkv[:, num_heads + num_kv_heads:]  # [T, KVH, D]
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    if hasattr(backend, "forward_rope"):  # the Triton backend: RoPE inside the KV write (decode: the attention)
        out = backend.forward_rope(attn.layer, q, k, v, positions, inv_freq, cache, meta)  # [T, H, D]
    else:
        rope_(q, k, positions, inv_freq)
        out = backend.forward(attn.layer, q, k, v, cache, meta)  # [T, H, D]
    return _reduce(F.linear(out.reshape(num_tokens, num_heads * head_dim), attn.o_proj.weight), attn.tp)


def _reduce(partial: torch.Tensor, tp: TensorParallelGroup | None) -> torch.Tensor:
    """Row-parallel projection output [T, hidden]: summed over the TP ranks (as it is without TP)."""
    return partial if tp is None else tp.all_reduce(partial)
