"""Gemma 2 (`Gemma2ForCausalLM`): its config mapping, its blocks and its registry entry (gemma3.py builds on them).

What differs from llama.py: the embedding scaled by sqrt(hidden); RMSNorm weights stored as offsets from 1
(x̂ · (1 + w), multiplied in fp32); each block norms the attention and MLP outputs too (four norms a layer); GeGLU
(tanh GELU) MLPs; attention logits scaled by query_pre_attn_scalar ** -0.5 and soft-capped
(cap · tanh(logits / cap)); local layers (layer_types "sliding_attention", the even ones by default) attend to a
sliding window; the LM head's logits soft-capped too. The checkpoint's tensor names are the model's.

Both attention backends apply each layer's soft-cap and window: the torch reference (attention/torch_ref.py) and
the Triton kernels (compiled variants; decode reads only the window's tiles). On the CUDA path Gemma 2 runs
model/gemma2_fused.py (fused projections, Triton norms and GELU·mul); Gemma 3 keeps this torch forward around the
Triton attention (its q/k norms and per-kind RoPE tables are not in the fused forward).
NOTE: every layer keeps its whole KV; a local layer only reads the window of it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata, LayerAttention
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.architecture import Architecture, same_weights
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.llama import Attention, LlamaForCausalLM
from services.gpu_worker.model.llama_family import dense_config, hf_values, param_shapes, rope_from_hf

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup

# transformers' Gemma2Config defaults, for keys a config.json may leave out.
_DEFAULTS = {
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "num_key_value_heads": 4, "head_dim": 256,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
_NULLABLE = ("sliding_window", "final_logit_softcapping", "attn_logit_softcapping")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


_FAMILY = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}  # model_type → the name errors give


def config_from_hf(cfg_dict: dict, model_id: str) -> ModelConfig:
    """A ModelConfig from a Gemma 2 config.json dict, with transformers' defaults for absent keys."""
    theta, scaling = rope_from_hf(cfg_dict)
    return gemma_config("gemma2", cfg_dict, _DEFAULTS, model_id, local_every=2, rope_theta=theta,
                        rope_scaling=scaling)


def gemma_config(arch: str, cfg_dict: dict, defaults: dict, model_id: str, local_every: int,
                 **fields: Any) -> ModelConfig:
    """The fields Gemma 2 and 3 read alike (norm eps, attention scale, soft-caps, window, local layers), plus fields.

    The local layers: those `layer_types` names "sliding_attention"; without that list, every layer but each
    `local_every`-th (Gemma 2: 2, the even ones local; Gemma 3: its `sliding_window_pattern`, 6 by default). They
    stay local (Gemma 3: their own RoPE base) when `sliding_window` is null, only without a window."""
    name = _FAMILY[arch]
    d = hf_values(cfg_dict, defaults)
    for key in _NULLABLE:  # an explicit null turns the feature off (hf_values drops nulls for the defaults)
        if key in cfg_dict:
            d[key] = cfg_dict[key]
    act = d.get("hidden_activation", d.get("hidden_act"))
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{name}: unsupported hidden_activation {act!r}; only 'gelu_pytorch_tanh' is supported")
    if d.get("use_bidirectional_attention") or d.get("attention_bias"):
        raise ValueError(f"{name}: use_bidirectional_attention and attention_bias are not supported")
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types") or ["full_attention" if (i + 1) % local_every == 0 else "sliding_attention"
                                           for i in range(num_layers)]
    window = d.get("sliding_window")
    return dense_config(
        arch, d, model_id, rms_norm_eps=float(d["rms_norm_eps"]),
        query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
        attn_logit_softcapping=_optional_float(d.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(d.get("final_logit_softcapping")),
        sliding_window=None if window is None else int(window),
        sliding_window_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"),
        **fields)


def _optional_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Llama layout plus each layer's pre- and post-feedforward norms."""
    shapes = param_shapes(cfg)
    for i in range(cfg.num_layers):
        for name in _NORMS[2:]:
            shapes[f"model.layers.{i}.{name}.weight"] = (cfg.hidden_size,)
    return shapes


def layer_attention(cfg: ModelConfig, layer: int) -> LayerAttention:
    window = cfg.sliding_window if layer in cfg.sliding_window_layers else None
    return LayerAttention(scale=cfg.query_pre_attn_scalar ** -0.5, softcap=cfg.attn_logit_softcapping,
                          sliding_window=window)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # stored as an offset from 1
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GeGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))  # [T, hidden]


class Gemma2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.self_attn.spec = layer_attention(cfg, layer)
        if cfg.qk_norm:  # Gemma 3: q and k normed over head_dim as Gemma norms them, (1 + w)
            self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.mlp = GeGLU(cfg)
        for name in _NORMS:
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, backend)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2Stack(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        if tp is not None:
            raise ValueError(f"{_FAMILY[cfg.arch]} does not run tensor parallel yet; use tensor_parallel_size=1")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma2Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """llama.py's model over Gemma 2's blocks: the same forward/logits/load_weights contract."""

    stack_class = Gemma2Stack

    def enable_fused_kernels(self) -> None:
        """CUDA: fused q/k/v and gate/up projections, Triton norms and GELU·mul (model/gemma2_fused.py)."""
        from services.gpu_worker.model import fused  # imports triton

        fused.fuse_projections(self)
        self.split_k_max_tokens = 0  # o/down_proj feed a post-norm, not the residual add split-K partials go to
        self.is_fused = True

    def fused_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      meta: AttentionMetadata, backend: AttentionBackend,
                      fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        from services.gpu_worker.model import gemma2_fused  # imports triton

        return gemma2_fused.forward(self, input_ids, positions, cache, meta, backend, fed)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] → [T, hidden]: the rows times sqrt(hidden), that factor rounded to their dtype as in HF."""
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(math.sqrt(self.config.hidden_size), dtype=h.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] → [B, vocab] fp32, soft-capped."""
        return soft_cap(super().logits(hidden), self.config.final_logit_softcapping)


GEMMA2 = Architecture(
    hf_name="Gemma2ForCausalLM",
    model_type="gemma2",
    config_from_hf=config_from_hf,
    checkpoint_shapes=checkpoint_shapes,
    to_model_weights=same_weights,
    model_class=Gemma2ForCausalLM,
    model_shapes=checkpoint_shapes,
)
