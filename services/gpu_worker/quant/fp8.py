"""FP8 W8A8: e4m3 weights scaled per output channel, e4m3 activations scaled per token on the fly.

Why these granularities: a per-channel weight scale and a per-token activation scale are the finest that still fold
into the GEMM's epilogue (out[m, n] = sx[m] · sw[n] · Σ_k qx[m, k] · qw[n, k]), so the FP8 tensor cores run the
whole reduction; it is the layout of the Hugging Face compressed-tensors "FP8-Dynamic" checkpoints, which load here
as published (load_compressed_tensors_fp8).

fp8_linear takes torch._scaled_mm where the GPU has FP8 tensor cores (compute capability ≥ 8.9); elsewhere it
computes the same numbers by dequantizing: the activations are quantized on that path too, so the CPU's result is
the GPU's up to the accumulation order. One token on CUDA (batch-1 decode) is the exception: the Triton GEMV reads the
e4m3 weight against x unquantized (W8A16), the faster and the more exact of the two there.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def _scaled_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] → (e4m3 [R, C], float32 scale [R]) with each row's amax mapped to FP8_MAX (an all-zero row: 1)."""
    amax = x.abs().amax(dim=1).float()  # [R]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [R]
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [R, C]
    return q, scale


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] → (qweight e4m3 [N, K], scale float32 [N]), per output channel."""
    return _scaled_rows(w)


def quantize_activation_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] → (qx e4m3 [M, K], scale float32 [M, 1]), dynamic per token: on CUDA one Triton launch
    (kernels/fp8_quant.py, the same bits), elsewhere the torch ops."""
    if x.is_cuda:  # imported here: kernel modules load only where Triton runs (kernels/__init__.py)
        from services.gpu_worker.kernels.fp8_quant import quantize_rows_fp8

        return quantize_rows_fp8(x.contiguous())
    qx, scale = _scaled_rows(x)
    return qx, scale[:, None]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q: [R, C] e4m3, scale: [R] or [R, 1] → float32 [R, C]."""
    return q.float() * scale.reshape(-1, 1).float()


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs on this device: CUDA with FP8 tensor cores (Ada sm_89, Hopper sm_90 and up)."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once (every forward of every layer asks)."""
    return torch.cuda.get_device_capability(index)


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K]; qweight: e4m3 [N, K]; weight_scale: float32 [N] → [M, N] in out_dtype (default x's).

    The activations are quantized per token here (W8A8), except at one token on CUDA: there the Triton GEMV reads the
    e4m3 weight with x in its own dtype (W8A16, kernels/gemv.py), since the step reads only the weight's bytes and
    quantizing x would add error and two launches for nothing."""
    out_dtype = out_dtype or x.dtype
    if x.is_cuda and x.shape[0] == 1 and out_dtype == x.dtype:  # imported here: kernels load only where Triton runs
        from services.gpu_worker.kernels.gemv import gemv

        return gemv(x.contiguous(), qweight, None if bias is None else bias.to(x.dtype), scale=weight_scale.float())
    qx, sx = quantize_activation_fp8(x)  # [M, K], [M, 1]
    if has_fp8_matmul(x.device) and _scaled_mm_shapes_ok(qx, qweight):
        rowwise = out_dtype == torch.bfloat16 and _capability(x.device.index) >= (9, 0)
        out = _scaled_mm(qx, sx, qweight, weight_scale.float(), out_dtype, rowwise)
    else:
        out = (dequantize_fp8(qx, sx) @ dequantize_fp8(qweight, weight_scale).t()).to(out_dtype)  # [M, N]
    return out if bias is None else out + bias.to(out_dtype)


def _scaled_mm_shapes_ok(qx: torch.Tensor, qweight: torch.Tensor) -> bool:
    """cuBLASLt's FP8 GEMM wants K and N multiples of 16."""
    return qx.shape[1] % 16 == 0 and qweight.shape[0] % 16 == 0


def _scaled_mm(qx: torch.Tensor, sx: torch.Tensor, qweight: torch.Tensor, sw: torch.Tensor,
               out_dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """qx [M, K] row-major, sx [M, 1]; qweight [N, K] row-major (so qweight.t() is the column-major [K, N] that
    _scaled_mm wants as its second operand), sw [N] → [M, N] out_dtype.

    rowwise (fp8_linear: a bfloat16 output on Hopper and up): the scales applied in the GEMM's epilogue, torch's
    rowwise path, which writes bfloat16. Otherwise (Ada sm_89, or a float16 / float32 output, which bfloat16 would
    round more coarsely): unit tensor-wise scales, a float32 output and the two scales applied after, the same
    numbers in one more pass."""
    if rowwise:
        return torch._scaled_mm(qx.contiguous(), qweight.t(), scale_a=sx.contiguous(),
                                scale_b=sw.reshape(1, -1).contiguous(), out_dtype=torch.bfloat16)  # [M, N]
    one = torch.ones((), dtype=torch.float32, device=qx.device)
    out = torch._scaled_mm(qx.contiguous(), qweight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * sx * sw.reshape(1, -1)).to(out_dtype)


def load_compressed_tensors_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A compressed-tensors FP8 checkpoint's `weight` (e4m3 [N, K]) and `weight_scale` ([N, 1] per channel, or
    [] / [1] per tensor; float32 or bfloat16) → (qweight e4m3 [N, K], scale float32 [N])."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"expected an e4m3 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    scale = weight_scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(n)
    elif scale.numel() != n:
        raise ValueError(f"weight_scale of shape {tuple(weight_scale.shape)} fits neither [{n}, 1] nor a scalar")
    return weight, scale.contiguous()


def is_compressed_tensors_fp8(quantization_config: dict[str, Any] | None) -> bool:
    """Whether config.json's `quantization_config` describes FP8 weights this module loads: compressed-tensors,
    format float-quantized (or naive-quantized), every config group's weights 8-bit float static per channel or per
    tensor, its input activations (if quantized) 8-bit float dynamic per token, which fp8_linear computes anyway.

    Its `ignore` list (typically ["lm_head"]) names the layers left dense."""
    cfg = quantization_config or {}
    if cfg.get("quant_method") != "compressed-tensors":
        return False
    if cfg.get("format", "float-quantized") not in ("float-quantized", "naive-quantized"):
        return False
    groups = cfg.get("config_groups") or {}
    return bool(groups) and all(_is_fp8_group(g) for g in groups.values())


def _is_fp8_group(group: dict[str, Any]) -> bool:
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    weights_ok = (_is_fp8_args(weights) and weights.get("strategy") in ("channel", "tensor")
                  and not weights.get("dynamic", False))
    inputs_ok = inputs is None or (_is_fp8_args(inputs) and inputs.get("strategy") == "token"
                                   and inputs.get("dynamic") is True)
    return weights_ok and inputs_ok


def _is_fp8_args(args: dict[str, Any]) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "float"
