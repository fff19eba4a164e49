"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type gemma3_text): its config mapping, its model and its registry
entry, over gemma2.py's blocks.

What differs from Gemma 2: q and k are RMS-normed over head_dim before RoPE, Gemma-style (x̂ · (1 + w)); the local
layers (five in six by default: `sliding_window_pattern`, or `layer_types`) rotate with their own RoPE base
(`rope_local_base_freq`, 10 000, never scaled) and the global ones with `rope_theta` (1 000 000) and its
`rope_scaling`; soft-capping is off unless config.json sets it. Embedding scale, the four norms a layer, GeGLU,
query_pre_attn_scalar and the window are Gemma 2's. The checkpoint's tensor names are the model's.

The multimodal Gemma 3 (`Gemma3ForConditionalGeneration`, a vision tower and text_config) is not served.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.gpu_worker.model.architecture import Architecture, same_weights
from services.gpu_worker.model.config import ModelConfig, RopeScaling
from services.gpu_worker.model.gemma2 import Gemma2ForCausalLM, checkpoint_shapes, gemma_config
from services.gpu_worker.model.llama_family import rope_from_hf
from services.gpu_worker.model.rope import cos_sin, inv_frequencies

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup

# transformers' Gemma3TextConfig defaults, for keys a config.json may leave out.
_DEFAULTS = {
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "num_key_value_heads": 4, "head_dim": 256,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


def config_from_hf(cfg_dict: dict, model_id: str) -> ModelConfig:
    """A ModelConfig from a Gemma 3 text config.json dict, with transformers' defaults for absent keys."""
    theta, scaling, local_theta = _ropes(cfg_dict)
    pattern = int(cfg_dict.get("sliding_window_pattern") or _DEFAULTS["sliding_window_pattern"])
    return gemma_config("gemma3_text", cfg_dict, _DEFAULTS, model_id, local_every=pattern, qk_norm=True,
                        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)


def _ropes(cfg_dict: dict) -> tuple[float, RopeScaling | None, float]:
    """(global base, global scaling, local base): from transformers 5's `rope_parameters`, one dict per layer kind,
    or from the released checkpoints' rope_theta, rope_scaling and rope_local_base_freq."""
    params = cfg_dict.get("rope_parameters") or {}
    if not {"full_attention", "sliding_attention"} & params.keys():
        params = {"full_attention": {"rope_theta": cfg_dict.get("rope_theta") or _GLOBAL_THETA,
                                     **(cfg_dict.get("rope_scaling") or {})},
                  "sliding_attention": {"rope_theta": cfg_dict.get("rope_local_base_freq") or _LOCAL_THETA}}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"Gemma 3: unsupported rope scaling {local_type!r} on the local layers; supported: none")
    theta, scaling = rope_from_hf({"rope_parameters": {"rope_theta": _GLOBAL_THETA, **full}})
    return theta, scaling, float(local.get("rope_theta", _LOCAL_THETA))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's model with q/k norms (gemma2.Gemma2Layer adds them when cfg.qk_norm) and a RoPE table per layer
    kind: `inv_freq` (rope_theta, rope_scaling) for the global layers, `local_inv_freq` for the local ones."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(cfg, tp)
        local_theta = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        self.register_buffer("local_inv_freq", inv_frequencies(cfg.head_dim, local_theta, None), persistent=False)
        self.is_local = [i in cfg.sliding_window_layers for i in range(cfg.num_layers)]

    def enable_fused_kernels(self) -> None:
        """Nothing fused: gemma2_fused.py has one RoPE table and no q/k norms, so the torch forward stays and only
        its attention runs on the Triton backend."""

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) [T, head_dim]: the local table on local layers, the global one elsewhere."""
        table = cos_sin(positions, self.inv_freq, dtype)
        local = cos_sin(positions, self.local_inv_freq, dtype)
        return [local if is_local else table for is_local in self.is_local]


GEMMA3 = Architecture(
    hf_name="Gemma3ForCausalLM",
    model_type="gemma3_text",
    config_from_hf=config_from_hf,
    checkpoint_shapes=checkpoint_shapes,
    to_model_weights=same_weights,
    model_class=Gemma3ForCausalLM,
    model_shapes=checkpoint_shapes,
)
