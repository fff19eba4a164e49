"""Megatron-style slices of a full Hugging Face-named Llama state dict, one per tensor-parallel rank.

Rank r of tp holds (H query heads, KVH kv heads, I intermediate, D head_dim):

    q_proj  weight [H*D, hidden] (+ bias)    rows of query heads [r*H/tp, (r+1)*H/tp)      column parallel
    k_proj, v_proj [KVH*D, hidden] (+ bias)  rows of kv heads [r*KVH/tp, (r+1)*KVH/tp)     column parallel
    o_proj  weight [hidden, H*D]             the matching input columns; all_reduce after    row parallel
    gate_proj, up_proj [I, hidden]           rows [r*I/tp, (r+1)*I/tp)                       column parallel
    down_proj [hidden, I]                    the matching input columns; all_reduce after    row parallel
    mlp.experts.gate_up_proj [E, 2 Im, hidden]  each expert's gate rows [r*Im/tp, (r+1)*Im/tp) and the same up rows
    mlp.experts.down_proj [E, hidden, Im]    the matching input columns; all_reduce after
    mlp.gate (the MoE router)                replicated: every rank routes alike
    embed_tokens, lm_head, every norm (q_norm / k_norm too): replicated
    a quantized checkpoint's layers (shard_linear_layers): the same split, each with its scales

Contiguous blocks of query heads keep GQA intact: query head h reads kv head h // (H/KVH), so rank r's query
heads read exactly rank r's kv heads. The slicing works on any loader's output (HF directory, bundled GGUF,
random:<preset>): they all produce the same HF names and layout.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from services.gpu_worker.model.config import ModelConfig

_ROWS = re.compile(r".*\.(self_attn\.(q|k|v)_proj\.(weight|bias)|mlp\.(gate|up)_proj\.weight)")
_COLUMNS = re.compile(r".*\.(self_attn\.o_proj|mlp\.down_proj)\.weight")
_EXPERT_GATE_UP = re.compile(r".*\.mlp\.experts\.gate_up_proj")
_EXPERT_DOWN = re.compile(r".*\.mlp\.experts\.down_proj")


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError unless tp_size splits the model's query heads, kv heads and intermediate size evenly."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, not {tp_size}")
    name = cfg.model_id or cfg.arch
    counts = [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)]
    if not cfg.num_experts or cfg.dense_mlp_layers:
        counts.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        counts.append(("moe_intermediate_size", cfg.moe_intermediate_size))
    for what, count in counts:
        if count % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide {name}'s {what}={count}: "
                             f"each rank must hold a whole, equal share of the heads and of the MLP")


def shard_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every tensor (views of the full tensors; replicated ones are the full tensors).

    The model copies the slices into its own parameters (load_weights); the full dict can be dropped then.
    """
    check_tensor_parallel(cfg, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of size {tp_size}")
    if tp_size == 1:
        return dict(state_dict)
    return {name: _slice(name, tensor, rank, tp_size) for name, tensor in state_dict.items()}


_COLUMN_LAYER = re.compile(r".*\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)")
_ROW_LAYER = re.compile(r".*\.(self_attn\.o_proj|mlp\.down_proj)")


def shard_linear_layers(layers: dict[str, Any], rank: int, tp_size: int) -> dict[str, Any]:
    """Rank `rank`'s slices of whole layers a quantized checkpoint holds (quant/linear.py QuantizedLinear, keyed by
    module name), split as shard_state_dict splits the dense weights of the same names: q/k/v and gate/up by output
    rows, o and down by input columns (QuantizedLinear.shard)."""
    out = {}
    for prefix, layer in layers.items():
        if _COLUMN_LAYER.fullmatch(prefix):
            out[prefix] = layer.shard(rank, tp_size, 0)
        elif _ROW_LAYER.fullmatch(prefix):
            out[prefix] = layer.shard(rank, tp_size, 1)
        else:
            raise ValueError(f"{prefix}: a quantized layer with no tensor-parallel split (q/k/v, o, gate/up and down "
                             "have one)")
    return out


def _slice(name: str, tensor: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    if _ROWS.fullmatch(name):
        return tensor.chunk(tp_size, dim=0)[rank]  # [rows / tp, ...]: whole heads (rows are head-major)
    if _COLUMNS.fullmatch(name):
        return tensor.chunk(tp_size, dim=1)[rank]  # [hidden, cols / tp]
    if _EXPERT_GATE_UP.fullmatch(name):  # [E, 2 Im, hidden]: gate rows, then up rows
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp_size, dim=1)[rank], up.chunk(tp_size, dim=1)[rank]], dim=1)
    if _EXPERT_DOWN.fullmatch(name):
        return tensor.chunk(tp_size, dim=2)[rank]  # [E, hidden, Im / tp]
    return tensor
