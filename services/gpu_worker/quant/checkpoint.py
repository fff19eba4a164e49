"""Quantized checkpoints as published: config.json's `quantization_config` names the method, and each quantized
linear layer's tensors load into a QuantizedLinear as they are (never dequantized and quantized again).

    AutoAWQ (quant_method "awq", version "gemm", 4 bits, zero points):  <layer>.qweight, .qzeros, .scales
    GPTQ v1 (quant_method "gptq", 4 bits, any group size, act-order):   <layer>.qweight, .qzeros, .scales, .g_idx
    compressed-tensors FP8 ("FP8-Dynamic": e4m3 weights per channel
        or per tensor, activations dynamic per token):               <layer>.weight (e4m3), .weight_scale

Layers without those tensors (the LM head, anything in the config's ignore lists) load dense as usual. The
checkpoint's layer names must be the model's own (Llama, Qwen2/3, Mistral, Gemma): a family whose loader renames or
splits weights (Phi-3's fused qkv) is refused for quantized checkpoints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.gpu_worker.quant.fp8 import is_compressed_tensors_fp8, load_compressed_tensors_fp8
from services.gpu_worker.quant.int4 import from_awq, from_gptq
from services.gpu_worker.quant.linear import QuantizedLinear

_INT4_SUFFIXES = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


def checkpoint_method(cfg_dict: dict[str, Any]) -> str | None:
    """config.json → "awq", "gptq", "fp8", or None (not quantized); ValueError naming what is unsupported."""
    qcfg = cfg_dict.get("quantization_config")
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        if not is_compressed_tensors_fp8(qcfg):
            raise ValueError("this compressed-tensors checkpoint is not FP8 W8A8 (e4m3 weights per channel or per "
                             "tensor, dynamic per-token activations): the only compressed-tensors layout served")
        return "fp8"
    if method not in _INT4_SUFFIXES:
        raise ValueError(f"quantized checkpoints of quant_method {method!r} are not supported: awq, gptq (4-bit) and "
                         "compressed-tensors FP8 are")
    if qcfg.get("bits", qcfg.get("w_bit")) != 4:
        raise ValueError(f"{method} checkpoints of {qcfg.get('bits', qcfg.get('w_bit'))} bits are not supported: 4 is")
    if method == "awq" and (str(qcfg.get("version", "gemm")).lower() != "gemm" or not qcfg.get("zero_point", True)):
        raise ValueError("AWQ checkpoints load in the GEMM version with zero points only")
    if method == "gptq" and str(qcfg.get("checkpoint_format", "gptq")).lower() != "gptq":
        raise ValueError(f"GPTQ checkpoint_format {qcfg.get('checkpoint_format')!r} is not supported: gptq (v1) is")
    return method


def group_size_of(cfg_dict: dict[str, Any]) -> int:
    """The int4 group size; -1 (GPTQ per channel) comes back as 0: one group per row, sized per layer."""
    qcfg = cfg_dict["quantization_config"]
    size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    return 0 if size == -1 else size


def quantized_prefixes(names: set[str], method: str) -> set[str]:
    """The layer names (`model.layers.0.self_attn.q_proj`) whose quantized tensors the checkpoint holds."""
    marker = "weight_scale" if method == "fp8" else "qweight"
    return {name.removesuffix(f".{marker}") for name in names if name.endswith(f".{marker}")}


def read_quantized_linears(files: list[Path], prefixes: set[str], method: str, group_size: int, dtype: torch.dtype,
                           device: str | torch.device) -> dict[str, QuantizedLinear]:
    """Each quantized layer of the checkpoint → a QuantizedLinear on `device`, its int4 scales and zeros (and any
    bias) in the model dtype, FP8 scales in float32."""
    from safetensors import safe_open

    wanted = {f"{p}.{s}": p for p in prefixes
              for s in (("weight", "weight_scale", "bias") if method == "fp8" else (*_INT4_SUFFIXES[method], "bias"))}
    tensors: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in wanted:
                    tensors[wanted[name]][name.rsplit(".", 1)[1]] = f.get_tensor(name)
    return {prefix: _linear(prefix, parts, method, group_size, dtype).to(device)
            for prefix, parts in tensors.items()}


def _linear(prefix: str, parts: dict[str, torch.Tensor], method: str, group_size: int,
            dtype: torch.dtype) -> QuantizedLinear:
    needed = ("weight", "weight_scale") if method == "fp8" else _INT4_SUFFIXES[method]
    missing = [s for s in needed if s not in parts and s != "g_idx"]  # g_idx is optional (trivial)
    if missing:
        raise ValueError(f"{prefix}: quantized tensors missing: {', '.join(missing)}")
    bias = parts["bias"].to(dtype) if "bias" in parts else None
    if method == "fp8":
        return QuantizedLinear.fp8(*load_compressed_tensors_fp8(parts["weight"], parts["weight_scale"]), bias)
    size = group_size or parts["qweight"].shape[0] * (8 if method == "gptq" else 1)  # per channel: G = K
    if method == "awq":
        weight = from_awq(parts["qweight"], parts["qzeros"], parts["scales"], size)
    else:
        weight = from_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), size)
    weight.scales, weight.zeros = weight.scales.to(dtype), weight.zeros.to(dtype)
    return QuantizedLinear.int4(weight, bias)


def install_(model: torch.nn.Module, linears: dict[str, QuantizedLinear]) -> dict[str, torch.Tensor]:
    """Put each QuantizedLinear in place of the model's module of that name (in place) → their tensors under the
    model's state-dict names, for the load that fills the rest of the model."""
    state: dict[str, torch.Tensor] = {}
    for prefix, linear in linears.items():
        parent_name, _, name = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, name, None)
        if not isinstance(old, torch.nn.Linear):
            raise ValueError(f"the checkpoint quantizes {prefix}, which is not a linear layer of this model")
        if (old.in_features, old.out_features) != (linear.in_features, linear.out_features):
            raise ValueError(f"{prefix}: quantized {linear.in_features}→{linear.out_features}, the model's layer is "
                             f"{old.in_features}→{old.out_features}")
        setattr(parent, name, linear)
        state.update({f"{prefix}.{key}": value for key, value in linear.state_dict().items()})
    return state
