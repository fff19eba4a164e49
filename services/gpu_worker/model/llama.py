"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, Phi-3; Mixtral and Qwen3-MoE with the
routed-experts MLP of moe.py) over a paged KV cache.

Parameter names equal Hugging Face's, so a transformers state dict loads as it is.

Tensor parallelism (a TensorParallelGroup `tp`, parallel/): each rank holds num_heads/tp query heads,
num_kv_heads/tp kv heads and intermediate_size/tp of the MLP (parallel/shard.py slices the full weights at
load), and sums o_proj's and down_proj's partial products over the ranks (all_reduce). The embedding, the
norms and the LM head stay replicated, so every rank ends a forward with the same hidden states and logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention.base import DEFAULT_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.moe import SparseMoe
from services.gpu_worker.model.rope import apply_rope, cos_sin, inv_frequencies

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        tp_size = 1 if tp is None else tp.size
        self.num_heads = cfg.num_heads // tp_size  # this rank's query heads
        self.num_kv_heads = cfg.num_kv_heads // tp_size  # this rank's kv heads (its KV cache holds only these)
        self.head_dim = cfg.head_dim
        # the layer's scale, soft-cap and window (a family may set its own: gemma2.py)
        is_windowed = cfg.sliding_window is not None and layer in cfg.sliding_window_layers
        self.spec = LayerAttention(sliding_window=cfg.sliding_window) if is_windowed else DEFAULT_ATTENTION
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(self.layer, q, k, v, cache, meta, self.spec)  # [T, H, D]
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))  # [T, hidden]
        return out if self.tp is None else self.tp.all_reduce(out)  # TP: the sum of every rank's heads


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        intermediate = cfg.intermediate_size // (1 if tp is None else tp.size)  # this rank's share
        self.gate_proj = nn.Linear(cfg.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, hidden]
        return out if self.tp is None else self.tp.all_reduce(out)  # TP: the sum over the intermediate shares


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = SparseMoe(cfg, tp) if cfg.is_moe_layer(layer) else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated under TP
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(): new tokens of a mixed prefill/decode batch → final hidden states; logits() on a few rows.

    tp: this rank's tensor-parallel group (None: the whole model on one device). `config` stays the full
    model's; the attention and MLP modules carry this rank's head and intermediate counts.
    """

    stack_class: type[nn.Module] = DecoderStack  # embed_tokens, layers, norm (a family's own blocks: gemma2.py)

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        if tp is not None:
            from services.gpu_worker.parallel.shard import check_tensor_parallel

            check_tensor_parallel(cfg, tp.size)
        self.config = cfg
        self.tp = tp
        self.model = self.stack_class(cfg, tp)
        if not cfg.tie_word_embeddings:  # replicated under TP: every rank computes the full logits
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        self.is_fused = False
        # fused forward: steps of at most this many tokens run the projections and the LM head on the Triton GEMV
        # (kernels/gemv.py) instead of cuBLAS; 0: never. Set by the engine (EngineConfig.gemv_max_tokens).
        self.gemv_max_tokens = 0

    def enable_fused_kernels(self) -> None:
        """CUDA only: fused projections and the Triton RMSNorm/RoPE/SiLU·mul kernels (model/fused.py); a
        mixture-of-experts layer keeps its routed-experts module (moe.py: the fused Triton MoE kernel on CUDA)."""
        from services.gpu_worker.model import fused  # imports triton

        fused.fuse_projections(self)
        self.split_k_max_tokens = fused.SPLIT_K_MAX_TOKENS  # o/down_proj split-K at up to this many tokens
        self.is_fused = True

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend,
                fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] int64 → hidden: [T, hidden] (after the final norm).

        fed = (src [T], prev): row i's input token is prev[src[i]] where src[i] ≥ 0, input_ids[i] elsewhere
        (tokens the previous step sampled that the host has not read yet; a captured graph's inputs)."""
        if self.is_fused:
            return self.fused_forward(input_ids, positions, cache, meta, backend, fed)
        if fed is not None:
            input_ids = torch.where(fed[0] >= 0, fed[1][fed[0].clamp_min(0).long()], input_ids.long())
        h = self.embed(input_ids)  # [T, hidden]
        for layer, (cos, sin) in zip(self.model.layers, self.rope(positions, h.dtype)):
            h = layer(h, cos, sin, cache, meta, backend)
        return self.model.norm(h)

    def fused_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      meta: AttentionMetadata, backend: AttentionBackend,
                      fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """forward() once enable_fused_kernels() ran: model/fused.py (a family with other blocks has its own)."""
        from services.gpu_worker.model import fused

        return fused.forward(self, input_ids, positions, cache, meta, backend, fed)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE (cos, sin), [T, head_dim] each, at positions [T]: one table that every layer shares
        (a family whose layers differ in RoPE base builds one per kind: gemma3.py)."""
        return [cos_sin(positions, self.inv_freq, dtype)] * len(self.model.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] → [T, hidden]: the embedding rows (a family may scale them: gemma2.py)."""
        return self.model.embed_tokens(input_ids)

    def runs_only_our_kernels(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens launches no cuBLAS GEMM, so its kernels may use PDL (kernels/pdl.py): one
        token on the Triton GEMV. (With gemv_max_tokens > 1 an FP8 layer takes torch._scaled_mm from two tokens.)"""
        return self.is_fused and num_tokens == 1 and self.gemv_max_tokens >= 1

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] → [B, vocab] fp32."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self.is_fused and 0 < hidden.shape[0] <= self.gemv_max_tokens:
            from services.gpu_worker.kernels import pdl
            from services.gpu_worker.kernels.gemv import gemv

            with pdl.scope(self.runs_only_our_kernels(hidden.shape[0])):
                return gemv(hidden, weight).float()
        return F.linear(hidden, weight).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor], local: dict[str, torch.Tensor] | None = None,
                     meta_to: tuple[torch.device, torch.dtype] | None = None) -> None:
        """Load an HF-named state dict; every parameter must be present and no extra key allowed.

        Under TP the dict is the full model's: this rank copies in its slices (parallel/shard.py). `local`: tensors
        already this rank's (a quantized checkpoint's layers, sliced whole), loaded as they are. meta_to: (device,
        dtype) of a model built with its parameters on meta (model/adopt.py), which takes the dict's tensors as its
        parameters where it can instead of copying them.
        """
        if self.tp is not None:
            from services.gpu_worker.parallel.shard import shard_state_dict

            state_dict = shard_state_dict(state_dict, self.config, self.tp.rank, self.tp.size)
        state_dict = {**state_dict, **(local or {})}
        if meta_to is not None:
            from services.gpu_worker.model.adopt import adopt_parameters_

            adopt_parameters_(self, state_dict, *meta_to)
        missing, unexpected = self.load_state_dict(state_dict, strict=False)
        unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
        if self.config.tie_word_embeddings:
            unexpected = [k for k in unexpected if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
