"""The mixture-of-experts families, Mixtral (`MixtralForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`): config
mapping, weight mapping and registry entries. Both run on llama.py with moe.py's routed MLP.

Their checkpoints hold one tensor per expert (what the released models and transformers' save_pretrained write):

    Mixtral    model.layers.N.block_sparse_moe.gate.weight           [E, hidden]
               model.layers.N.block_sparse_moe.experts.X.w1.weight   [I, hidden]   gate
               model.layers.N.block_sparse_moe.experts.X.w3.weight   [I, hidden]   up
               model.layers.N.block_sparse_moe.experts.X.w2.weight   [hidden, I]   down
    Qwen3-MoE  model.layers.N.mlp.gate.weight, model.layers.N.mlp.experts.X.{gate,up,down}_proj.weight

`stack_experts` stacks them into the model's fused layout (moe.py): gate_up_proj [E, 2 I, hidden], down_proj
[E, hidden, I]. A checkpoint already in that layout (transformers 5's in-memory names) loads as it is. Routing: Mixtral always renormalises its top-k probabilities; Qwen3-MoE when `norm_topk_prob`.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from services.gpu_worker.model.architecture import Architecture
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.llama_family import (dense_config, hf_values, param_shapes, rope_from_hf,
                                                   sliding_window_fields)

# transformers' MixtralConfig / Qwen3MoeConfig defaults, for keys a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                "bos_token_id": 1, "eos_token_id": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 4,
                  "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
_DEFAULT_ROPE_THETA = {"mixtral": 1e6, "qwen3_moe": 10000.0}
# the model's parameter name of each checkpoint expert tensor, and its part of gate_up_proj (0: gate, 1: up)
_EXPERT_NAMES = {
    "mixtral": (".block_sparse_moe.", {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}),
    "qwen3_moe": (".mlp.", {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                            "down_proj": ("down_proj", 0)}),
}


def config_from_hf(model_type: str, cfg_dict: dict, model_id: str) -> ModelConfig:
    """A ModelConfig from a Mixtral or Qwen3-MoE config.json dict, with transformers' defaults for absent keys.

    A Mixtral `sliding_window` windows every layer; a Qwen3-MoE with use_sliding_window is refused."""
    d = hf_values(cfg_dict, _DEFAULTS[model_type])
    name = "Mixtral" if model_type == "mixtral" else "Qwen3-MoE"
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: unsupported hidden_act {d['hidden_act']!r}; only 'silu' is supported")
    theta, scaling = rope_from_hf(cfg_dict)
    if "rope_theta" not in cfg_dict and "rope_theta" not in (cfg_dict.get("rope_parameters") or {}):
        theta = _DEFAULT_ROPE_THETA[model_type]
    num_experts = int(d.get("num_experts", d["num_local_experts"]))  # Qwen3-MoE's files spell either
    fields: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(d["rms_norm_eps"]),
                                  num_experts=num_experts, num_experts_per_tok=int(d["num_experts_per_tok"]))
    if model_type == "mixtral":
        fields |= dict(moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                       **sliding_window_fields(d))
    else:
        if d.get("use_sliding_window"):
            raise ValueError("Qwen3-MoE: use_sliding_window=true is not supported")
        step = int(d["decoder_sparse_step"])
        dense = {int(i) for i in d["mlp_only_layers"]}
        dense |= {i for i in range(int(d["num_hidden_layers"])) if (i + 1) % step}
        fields |= dict(moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=bool(d["norm_topk_prob"]),
                       dense_mlp_layers=tuple(sorted(dense)), qk_norm=True,
                       attention_bias=bool(d.get("attention_bias", False)))
    return dense_config(model_type, d, model_id, **fields)


def checkpoint_shapes(model_type: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors: the model's (llama_family.param_shapes) with every MoE layer's fused experts as
    one tensor per expert and projection, under the family's names."""
    block, names = _EXPERT_NAMES[model_type]
    h, moe = cfg.hidden_size, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".mlp.experts.down_proj"):
            continue
        if not name.endswith(".mlp.experts.gate_up_proj"):
            shapes[name.replace(".mlp.gate.", block + "gate.")] = shape
            continue
        prefix = name.removesuffix("mlp.experts.gate_up_proj") + block.lstrip(".") + "experts."
        for e in range(cfg.num_experts):
            for ckpt_name, (param, _) in names.items():
                shapes[f"{prefix}{e}.{ckpt_name}.weight"] = (h, moe) if param == "down_proj" else (moe, h)
    return shapes


def stack_experts(model_type: str, state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names → the model's: each layer's per-expert tensors stacked into gate_up_proj [E, 2 I, hidden]
    (gate rows, then up rows) and down_proj [E, hidden, I]; the router renamed to mlp.gate.weight."""
    block, names = _EXPERT_NAMES[model_type]
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            param = name.rsplit(".", 1)[1]
            prefix = name.removesuffix("mlp.experts." + param) + block.lstrip(".") + "experts."
            parts = sorted((part, ckpt) for ckpt, (p, part) in names.items() if p == param)  # gate before up
            out[name] = torch.stack([torch.cat([state_dict[f"{prefix}{e}.{ckpt}.weight"] for _, ckpt in parts])
                                     for e in range(cfg.num_experts)])
        else:
            out[name] = state_dict[name.replace(".mlp.gate.", block + "gate.")]
    return out


def _entry(hf_name: str, model_type: str) -> Architecture:
    return Architecture(
        hf_name=hf_name,
        model_type=model_type,
        config_from_hf=partial(config_from_hf, model_type),
        checkpoint_shapes=partial(checkpoint_shapes, model_type),
        to_model_weights=partial(stack_experts, model_type),
        model_class=LlamaForCausalLM,
        accepts_model_layout=True,
    )


MIXTRAL = _entry("MixtralForCausalLM", "mixtral")
QWEN3_MOE = _entry("Qwen3MoeForCausalLM", "qwen3_moe")
