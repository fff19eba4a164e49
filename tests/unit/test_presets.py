"""The real-shape random presets of the newer families, random:qwen3-30b-a3b and random:gemma2-9b: their configs
equal what the published config.json maps to, and the engine's model class takes the weights the loader would draw
for them (built on the meta device: no memory allocated)."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.model.loader import config_from_hf, model_shapes
from services.gpu_worker.model.presets import preset
from services.gpu_worker.model.registry import architecture_for_type

# the published config.json keys that matter (Qwen/Qwen3-30B-A3B, google/gemma-2-9b)
PUBLISHED = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    "gemma2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "bos_token_id": 2, "eos_token_id": 1},
}
# parameter counts of the published checkpoints
TOTAL = {"qwen3-30b-a3b": 30_532_122_624, "gemma2-9b": 9_241_705_984}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_equals_the_published_config(name: str) -> None:
    cfg = preset(name)
    assert cfg.model_id == f"random:{name}"
    assert config_from_hf(PUBLISHED[name], cfg.model_id) == cfg


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_model_class_takes_the_presets_weights(name: str) -> None:
    """What the engine does with a preset (architecture_for_type → model_class(cfg) → load_weights of
    loader.random_state_dict's names and shapes), on meta tensors."""
    cfg = preset(name)
    shapes = model_shapes(cfg)
    with torch.device("meta"):
        model = architecture_for_type(cfg.arch).model_class(cfg)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    model.load_weights({n: torch.empty(s, device="meta") for n, s in shapes.items()})
    assert sum(torch.Size(s).numel() for s in shapes.values()) == TOTAL[name]
