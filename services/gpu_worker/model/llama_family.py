"""The Llama-shaped families (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3): Hugging Face config mapping both ways,
the parameter layout every family loads into, and their registry entries (model class: llama.py)."""
from __future__ import annotations

from functools import partial
from typing import Any

from services.gpu_worker.model.architecture import Architecture, same_weights
from services.gpu_worker.model.config import ModelConfig, RopeScaling
from services.gpu_worker.model.llama import LlamaForCausalLM

# transformers' own defaults per model_type, for keys a config.json may leave out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {
        "max_position_embeddings": 131072,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_key_value_heads": 8,
    },
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model (llama.py), by its Hugging Face Llama name, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.is_moe_layer(i):  # model/moe.py
            e, moe = cfg.num_experts, cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * moe, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, moe)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def hf_values(cfg_dict: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """config.json's non-null keys over the family's defaults; ValueError naming any required key it lacks."""
    missing = [k for k in HF_REQUIRED if cfg_dict.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
    return {**defaults, **{k: v for k, v in cfg_dict.items() if v is not None}}


def eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def config_from_hf(model_type: str, cfg_dict: dict, model_id: str) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict, with transformers' defaults for absent keys."""
    _check_hf_unsupported(model_type, cfg_dict)
    d = hf_values(cfg_dict, _HF_DEFAULTS[model_type])
    theta, scaling = rope_from_hf(cfg_dict)
    return dense_config(model_type, d, model_id, rope_theta=theta, rope_scaling=scaling,
                        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                        attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
                        qk_norm=model_type == "qwen3", **sliding_window_fields(d))


def sliding_window_fields(d: dict) -> dict[str, Any]:
    """ModelConfig's sliding_window and sliding_window_layers from a config.json dict, as transformers reads them:
    `layer_types` ("sliding_attention" entries) where given; else Qwen's use_sliding_window windows the layers from
    max_window_layers on, and a plain `sliding_window` (Mistral 7B v0.1, Phi-3, Mixtral) every layer."""
    window = d.get("sliding_window")
    num_layers = int(d["num_hidden_layers"])
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        window = None  # Qwen's key: its sliding_window is inert without it
    if window is None:
        return {}
    if d.get("layer_types"):
        layers = tuple(i for i, kind in enumerate(d["layer_types"]) if kind == "sliding_attention")
    elif "use_sliding_window" in d:
        layers = tuple(range(int(d.get("max_window_layers", num_layers)), num_layers))
    else:
        layers = tuple(range(num_layers))
    return {"sliding_window": int(window), "sliding_window_layers": layers} if layers else {}


def dense_config(arch: str, d: dict, model_id: str, **fields: Any) -> ModelConfig:
    """The fields every dense decoder's config.json spells alike (d: its values, defaults filled in), plus fields."""
    heads = int(d["num_attention_heads"])
    common = dict(
        arch=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads", heads)),
        head_dim=int(d.get("head_dim", d["hidden_size"] // heads)),
        max_position_embeddings=int(d["max_position_embeddings"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids(d.get("eos_token_id")),
        model_id=model_id,
    )
    return ModelConfig(**{**common, **fields})


def _check_hf_unsupported(model_type: str, d: dict) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is supported")
    if d.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=true")
    if model_type == "mistral" and d.get("attention_bias"):
        raise ValueError("unsupported config: mistral with attention_bias=true")


def rope_from_hf(d: dict) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    theta = float(d.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: llama3, linear")


def config_to_hf(hf_name: str, cfg: ModelConfig) -> dict:
    """A config.json dict that transformers loads as the model equivalent to `cfg`."""
    _check_representable(cfg)
    eos = list(cfg.eos_token_ids)
    d: dict[str, Any] = {
        "architectures": [hf_name],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_to_hf(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if cfg.arch in ("llama", "qwen3"):
        d["attention_bias"] = cfg.attention_bias
    if cfg.arch == "llama":
        d["mlp_bias"] = False
    if cfg.arch in ("qwen2", "qwen3"):
        d["use_sliding_window"] = False
    if cfg.arch == "mistral":
        d["sliding_window"] = cfg.sliding_window if cfg.sliding_window_layers else None
    return d


def _check_representable(cfg: ModelConfig) -> None:
    if cfg.sliding_window_layers and (cfg.arch != "mistral"
                                      or cfg.sliding_window_layers != tuple(range(cfg.num_layers))):
        raise ValueError(f"{cfg.arch}: sliding-window layers {cfg.sliding_window_layers} are written for Mistral "
                         f"(every layer) only")
    if cfg.qk_norm != (cfg.arch == "qwen3"):
        raise ValueError(f"{cfg.arch}: qk_norm={cfg.qk_norm} has no transformers equivalent")
    if cfg.arch == "qwen2" and not cfg.attention_bias:
        raise ValueError("qwen2 always has q/k/v biases in transformers; set attention_bias=True")
    if cfg.arch == "mistral" and cfg.attention_bias:
        raise ValueError("mistral has no attention_bias in transformers")


def _rope_to_hf(scaling: RopeScaling | None) -> dict | None:
    if scaling is None:
        return None
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {
        "rope_type": scaling.rope_type,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def _entry(hf_name: str, model_type: str) -> Architecture:
    return Architecture(
        hf_name=hf_name,
        model_type=model_type,
        config_from_hf=partial(config_from_hf, model_type),
        checkpoint_shapes=param_shapes,
        to_model_weights=same_weights,
        model_class=LlamaForCausalLM,
        config_to_hf=partial(config_to_hf, hf_name),
    )


LLAMA = _entry("LlamaForCausalLM", "llama")
MISTRAL = _entry("MistralForCausalLM", "mistral")
QWEN2 = _entry("Qwen2ForCausalLM", "qwen2")
QWEN3 = _entry("Qwen3ForCausalLM", "qwen3")
