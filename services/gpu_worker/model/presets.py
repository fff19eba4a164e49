"""Named model shapes for random-weight runs: tiny ones for tests, real ones for benchmarks."""
from __future__ import annotations

from services.gpu_worker.model.config import ModelConfig, RopeScaling

_LLAMA3_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        arch="llama",
        **_TINY,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        bos_token_id=1,
        eos_token_ids=(2, 3),
    ),
    "tiny-mistral": ModelConfig(
        arch="mistral",
        **_TINY,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "tiny-qwen2": ModelConfig(
        arch="qwen2",
        **_TINY,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        attention_bias=True,
        eos_token_ids=(2,),
    ),
    "tiny-qwen3": ModelConfig(
        arch="qwen3",
        **{**_TINY, "head_dim": 32},
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        eos_token_ids=(2,),
    ),
    "tiny-smollm2": ModelConfig(
        arch="llama",
        **{**_TINY, "num_kv_heads": 1},
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama3-8b": ModelConfig(
        arch="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    # Qwen3-30B-A3B's config.json: 48 MoE layers (no dense one), 128 experts of which 8 routed, renormalised
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,  # unused: every layer is a MoE layer
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    # Gemma-2-9B's config.json: even layers local (window 4096), soft-caps 50 (attention) and 30 (logits)
    "gemma2-9b": ModelConfig(
        arch="gemma2",
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_layers=42,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256.0,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        sliding_window_layers=tuple(range(0, 42, 2)),
        bos_token_id=2,
        eos_token_ids=(1,),
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    "smollm2-135m": ModelConfig(
        arch="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}
PRESETS = {name: cfg.with_(model_id=f"random:{name}") for name, cfg in PRESETS.items()}


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset; ValueError naming the known presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]
