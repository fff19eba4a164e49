"""Phi-3 (`Phi3ForCausalLM`): a Llama-shaped decoder whose checkpoint fuses q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`. The fused tensors are split on load, so it runs on llama.py (whose CUDA path fuses them again).

The worked example of adding a family: a config mapping, a weight mapping and a registry line (registry.py).
"""
from __future__ import annotations

import torch

from services.gpu_worker.model.architecture import Architecture
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.llama_family import dense_config, hf_values, param_shapes, sliding_window_fields

# transformers' Phi3Config defaults, for keys a config.json may leave out.
_DEFAULTS = {
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
_FUSED = (".self_attn.qkv_proj.weight", ".mlp.gate_up_proj.weight")


def config_from_hf(cfg_dict: dict, model_id: str) -> ModelConfig:
    """A ModelConfig from a Phi-3 config.json dict (a `sliding_window` windows every layer)."""
    d = hf_values(cfg_dict, _DEFAULTS)
    if d["hidden_act"] != "silu":
        raise ValueError(f"Phi-3: unsupported hidden_act {d['hidden_act']!r}; only 'silu' is supported")
    return dense_config("phi3", d, model_id, rms_norm_eps=float(d["rms_norm_eps"]), rope_theta=_rope_theta(cfg_dict),
                        **sliding_window_fields(d))


def _rope_theta(d: dict) -> float:
    """Plain RoPE only: Phi-3's long-context scalings (longrope, formerly su/yarn) and partial rotary are refused."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"Phi-3: unsupported rope scaling type {rope_type!r}; supported: default (no rope_scaling)")
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"Phi-3: unsupported partial_rotary_factor {partial}; only 1.0 is supported")
    return float(d.get("rope_theta", params.get("rope_theta", 10000.0)))


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors: the Llama layout with q/k/v and gate/up each one fused tensor."""
    h = cfg.hidden_size
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith((".self_attn.k_proj.weight", ".self_attn.v_proj.weight", ".mlp.up_proj.weight")):
            continue
        if name.endswith(".self_attn.q_proj.weight"):
            name, shape = name.replace("q_proj", "qkv_proj"), (qkv_rows, h)
        elif name.endswith(".mlp.gate_proj.weight"):
            name, shape = name.replace("gate_proj", "gate_up_proj"), (2 * cfg.intermediate_size, h)
        shapes[name] = shape
    return shapes


def split_fused(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names → the model's: qkv_proj [(H + 2 KVH) * D, hidden] → q [H*D], k [KVH*D], v [KVH*D] rows
    (transformers' Phi3Attention slices it so); gate_up_proj [2 I, hidden] → gate (first I rows), up (last I)."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith(_FUSED[0]):
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split((q_rows, kv_rows, kv_rows))
            out |= {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
        elif name.endswith(_FUSED[1]):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            out |= {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up}
        else:
            out[name] = tensor
    return {name: out[name].contiguous() for name in param_shapes(cfg) if name in out}


PHI3 = Architecture(
    hf_name="Phi3ForCausalLM",
    model_type="phi3",
    config_from_hf=config_from_hf,
    checkpoint_shapes=checkpoint_shapes,
    to_model_weights=split_fused,
    model_class=LlamaForCausalLM,
)
