"""Quantizing a loaded model in place: every nn.Linear that quant/targets.py does not leave dense becomes a
QuantizedLinear.
"""
from __future__ import annotations

from torch import nn

from services.gpu_worker.quant.int4 import Int4Weight
from services.gpu_worker.quant.linear import LinearMethod, QuantizedLinear
from services.gpu_worker.quant.targets import linear_targets

METHODS = ("fp8", "awq", "gptq", "gguf")
"""The `quantization` values a model can be served with. "fp8": W8A8 e4m3 (quant/fp8.py). "awq" and "gptq" both mean
INT4 W4A16 (quant/int4.py): a bf16 checkpoint quantized on load gets activation-aware scales (quant/awq.py, calibrated
on quant/calibration.py's text where the model has a tokenizer) and round-to-nearest weights in the AWQ style
(asymmetric, groups of 128) either way; a real AWQ or GPTQ checkpoint is loaded as published (from_awq, from_gptq).
"gguf": the bundled GGUF's own 4-bit blocks as INT4 W4A16 (quant/gguf_int4.py), not a quantization of float weights,
so quantize_linears_ refuses it."""

_LINEAR_METHOD: dict[str, LinearMethod] = {"fp8": "fp8", "awq": "int4", "gptq": "int4"}


def quantize_linears_(model: nn.Module, method: str, skip: tuple[str, ...] = ("lm_head",),
                      group_size: int = 128, calibration: list[list[int]] | None = None,
                      grids: dict[nn.Linear, Int4Weight] | None = None) -> int:
    """Replace each nn.Linear of `model` by a QuantizedLinear of its weights (in place) unless a component of its
    qualified name is in `skip` or it is an MoE router; returns how many were replaced.

    Without `calibration` every layer is rounded to nearest. With it (token windows, quant/calibration.py), INT4
    folds activation-aware input-channel scales into the model first (quant/awq.py), then rounds to nearest, in the
    same format; FP8 ignores it and rounds to nearest (GPTQ-chosen FP8 weights, quant/gptq.py gptq_quantize_fp8,
    calibrate layer by layer through the CPU's FP8 forward: minutes, so `radixserve quantize` writes them offline,
    quant/writer.py). A layer in `grids` (quant/awq.py scale_activation_aware_'s, INT4 only) gets that weight as it
    is instead of RTN.
    A tensor-parallel shard (`model.tp` set) is rounded to nearest: the calibration forward
    (quality.sequence_logits) runs a whole model's attention."""
    if method not in _LINEAR_METHOD:
        raise ValueError(f"unknown quantization {method!r}: one of {METHODS}")
    if calibration and _LINEAR_METHOD[method] == "int4" and getattr(model, "tp", None) is None:
        from services.gpu_worker.quant.awq import scale_activation_aware_

        scale_activation_aware_(model, calibration, group_size)
    targets = linear_targets(model, skip)
    for _, parent, name, child in targets:
        if grids is not None and child in grids:
            bias = None if child.bias is None else child.bias.detach().clone()
            setattr(parent, name, QuantizedLinear.int4(grids[child], bias))
        else:
            setattr(parent, name, QuantizedLinear.from_linear(child, _LINEAR_METHOD[method], group_size))
    return len(targets)
