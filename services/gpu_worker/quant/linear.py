"""QuantizedLinear: an nn.Linear's stand-in whose weight is FP8 (W8A8) or INT4 (W4A16).

The quantized tensors are buffers, not parameters: nothing trains them, and `.to(device)` / `state_dict()` still
carry them. Quantize after casting the model to its serving dtype: `.to(dtype)` casts every floating buffer, the
e4m3 qweight and the float32 scales included. forward() flattens the leading dimensions into one [M, K] matmul
(fp8_linear or int4_linear) and returns x's dtype, so it drops into any module that called an nn.Linear.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from services.gpu_worker.quant.fp8 import fp8_linear, quantize_weight_fp8
from services.gpu_worker.quant.int4 import Int4Weight, int4_linear, quantize_int4

LinearMethod = Literal["fp8", "int4"]


class QuantizedLinear(nn.Module):
    """y = x Wᵀ + b with W quantized. method "fp8": buffers qweight (e4m3 [N, K]) and weight_scale (float32 [N]);
    "int4": qweight, scales, zeros and perm of an Int4Weight (quant/int4.py's layout)."""

    def __init__(self, method: LinearMethod, in_features: int, out_features: int,
                 tensors: dict[str, torch.Tensor | None], bias: torch.Tensor | None = None,
                 group_size: int = 0) -> None:
        super().__init__()
        if method not in ("fp8", "int4"):
            raise ValueError(f"unknown linear quantization {method!r}: 'fp8' or 'int4'")
        self.method = method
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size  # int4 only
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)

    @classmethod
    def fp8(cls, qweight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None = None) -> QuantizedLinear:
        """qweight: e4m3 [N, K]; weight_scale: float32 [N]."""
        n, k = qweight.shape
        return cls("fp8", k, n, {"qweight": qweight, "weight_scale": weight_scale}, bias)

    @classmethod
    def int4(cls, weight: Int4Weight, bias: torch.Tensor | None = None) -> QuantizedLinear:
        tensors = {"qweight": weight.qweight, "scales": weight.scales, "zeros": weight.zeros, "perm": weight.perm}
        return cls("int4", weight.in_features, weight.out_features, tensors, bias, weight.group_size)

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: LinearMethod, group_size: int = 128) -> QuantizedLinear:
        """Quantize a dense layer (RTN); int4 scales in the weight's dtype, groups of int4_group_size(K, group_size)."""
        weight = linear.weight.detach()  # [N, K]
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if method == "fp8":
            return cls.fp8(*quantize_weight_fp8(weight), bias)
        if method == "int4":
            return cls.int4(quantize_int4(weight, int4_group_size(weight.shape[1], group_size)), bias)
        raise ValueError(f"unknown linear quantization {method!r}: 'fp8' or 'int4'")

    def shard(self, rank: int, tp_size: int, dim: int) -> QuantizedLinear:
        """Rank `rank`'s slice for tensor parallelism (parallel/shard.py picks dim by the layer's name), copies that
        let the whole layer go. dim 0, column parallel: the output rows, each with its scales (and zero points, and
        bias). dim 1, row parallel: the input columns, every row's scale (FP8: one a row, whole) or its groups of
        those columns (INT4: the slice must be whole groups); a bias, which the all-reduce after the layer would add
        tp_size times, and an act-order permutation that moves input features across ranks' slices, are refused."""
        if dim not in (0, 1):
            raise ValueError(f"shard: dim 0 (output rows) or 1 (input columns), not {dim}")

        def part(t: torch.Tensor | None, d: int = dim) -> torch.Tensor | None:
            return None if t is None else t.chunk(tp_size, dim=d)[rank].clone()

        if dim == 1 and self.bias is not None:
            raise ValueError("a row-parallel quantized layer with a bias cannot be split: the all-reduce after it would "
                             f"add the bias {tp_size} times")
        if self.method == "fp8":
            return QuantizedLinear.fp8(part(self.qweight), part(self.weight_scale, 0) if dim == 0 else
                                       self.weight_scale.clone(), part(self.bias, 0))
        if dim == 0:
            return QuantizedLinear.int4(Int4Weight(part(self.qweight), part(self.scales), part(self.zeros),
                                                   self.group_size, self.perm), part(self.bias))
        width = self.in_features // tp_size
        if self.in_features % tp_size or width % self.group_size:
            raise ValueError(f"INT4 groups of {self.group_size} do not split {self.in_features} input features into "
                             f"{tp_size} whole-group slices")
        perm = None
        if self.perm is not None:  # packed column k reads input feature perm[k]: this slice's must be its own
            perm = self.perm[rank * width:(rank + 1) * width] - rank * width
            if perm.min() < 0 or perm.max() >= width:
                raise ValueError("an act-order INT4 layer (GPTQ desc_act) whose permutation moves input features "
                                 "between tensor-parallel ranks cannot be split row-wise")
            perm = perm.clone()
        return QuantizedLinear.int4(Int4Weight(part(self.qweight), part(self.scales), part(self.zeros),
                                               self.group_size, perm))

    def int4_weight(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] → [..., N] in x's dtype."""
        flat = x.reshape(-1, self.in_features)  # [M, K]
        if self.method == "fp8":
            out = fp8_linear(flat, self.qweight, self.weight_scale, self.bias, out_dtype=x.dtype)
        else:
            out = int4_linear(flat, self.int4_weight(), self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        return (f"method={self.method}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{group}")


def int4_group_size(in_features: int, requested: int = 128) -> int:
    """The group size for K = in_features: `requested` where it divides K, else their gcd (SmolLM2's K = 576 with
    128 → 64); ValueError where that is not a multiple of 8 (the packing's word)."""
    size = math.gcd(in_features, requested)
    if size % 8:
        raise ValueError(f"no INT4 group size ≤ {requested} that is a multiple of 8 divides K = {in_features}")
    return size
