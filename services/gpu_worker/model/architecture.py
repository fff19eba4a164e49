"""What an architecture declares to the registry: its config mapping, its weight mapping and its model class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from services.gpu_worker.model.config import ModelConfig


def same_weights(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The weight mapping of a checkpoint that already uses the model's names (every Llama-shaped family)."""
    return state_dict


@dataclass(frozen=True)
class Architecture:
    """One model family as a checkpoint names it.

    Loading a checkpoint: config.json → `config_from_hf` → ModelConfig (its `arch` is `model_type`); the
    safetensors tensors named in `checkpoint_shapes(cfg)` → `to_model_weights` → the model's own names (the
    Llama layout of loader.param_shapes: q/k/v_proj, gate/up_proj, ...) → `model_class(cfg, tp).load_weights`.
    """

    hf_name: str  # config.json's architectures[0], e.g. "Phi3ForCausalLM"
    model_type: str  # config.json's model_type; ModelConfig.arch
    config_from_hf: Callable[[dict, str], ModelConfig]  # (config.json dict, model_id) → ModelConfig
    checkpoint_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # the tensors the checkpoint holds
    to_model_weights: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    model_class: type[nn.Module]  # model_class(cfg, tp) with load_weights(state_dict), forward, logits
    config_to_hf: Callable[[ModelConfig], dict] | None = None  # config.json writer (bundled cache, test references)
    # a checkpoint may also hold the model's own names and layout (loader.param_shapes): read as it is, no mapping
    # (MoE: transformers 5's in-memory fused experts, gate_up_proj [E, 2 I, hidden], as some converters save them)
    accepts_model_layout: bool = False
    # the model's own parameters (names and shapes) where they are more than loader.param_shapes' Llama layout
    # (Gemma's four norms a layer); random presets draw these
    model_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] | None = None
