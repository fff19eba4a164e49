"""The one description of a Llama-family model's shape, read from a Hugging Face config.json, GGUF
metadata or a named random preset."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (Llama 3.1+). `rope_type` is "llama3" or "linear"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only Llama-family transformer.

    Covers Llama 2/3 (`rope_scaling`), Mistral, Qwen2 (`attention_bias`), Qwen3 (`qk_norm`), SmolLM2
    (`tie_word_embeddings`), Phi-3 (fused checkpoint tensors, split on load: model/phi3.py) and the
    mixture-of-experts Mixtral and Qwen3-MoE (`num_experts` > 0: model/moe.py, model/moe_families.py); Gemma 2
    (model/gemma2.py) adds soft-capping, its attention scale and sliding-window layers; Gemma 3 (model/gemma3.py) q/k
    norms and a RoPE base of its own for the local layers.
    """

    arch: str  # a registered model_type (model/registry.py): "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    num_experts: int = 0  # > 0: a mixture-of-experts model (its MLPs are routed experts)
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (intermediate_size: the dense layers')
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1 (Mixtral: always)
    dense_mlp_layers: tuple[int, ...] = ()  # MoE models: layers that keep a dense MLP (Qwen3-MoE mlp_only_layers)
    query_pre_attn_scalar: float | None = None  # Gemma 2: attention scale query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None = None  # Gemma 2: attention logits → cap · tanh(logits / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the LM head's logits likewise
    sliding_window: int | None = None  # the window of the layers in sliding_window_layers (positions, own included)
    sliding_window_layers: tuple[int, ...] = ()  # Gemma 2/3: the local layers (windowed when sliding_window is set)
    rope_local_theta: float | None = None  # Gemma 3: the local layers' RoPE base (unscaled); None: rope_theta
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_id: str = ""  # salts the block hashes; names the model in the API

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def with_(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token over all layers, at 2 bytes per element (bf16/fp16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2
