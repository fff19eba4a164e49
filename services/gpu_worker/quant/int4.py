"""INT4 weight-only quantization (W4A16): 4-bit weights in groups along K, each group with its own scale and zero
point; activations stay in the model dtype. Quartering the weight bytes is what a memory-bound decode step buys.

Internal layout (what int4_matmul and the CUDA kernel behind it read; N = out features, K = in features, G = group
size, K % G == 0, G % 8 == 0):

    qweight  int32 [N, K // 8]   packed along K: nibble i (bits 4i..4i+3) of word j holds k = 8j + i, unsigned 0..15
    scales   [N, K // G]         the model dtype
    zeros    [N, K // G]         the scales' dtype, the integer zero point held as a float (symmetric: 8)
    perm     int64 [K] or None   packed column k holds input feature perm[k] (GPTQ act-order); None: the identity

    w[n, perm[k]] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]

so y = x[:, perm] @ dequant(q).T: int4_linear gathers the activation columns once, and the kernel only ever sees
contiguous groups.

Published checkpoint layouts, read (from_*) and written (to_*) exactly:

  AutoAWQ GEMM: qweight int32 [K, N // 8] and qzeros int32 [K // G, N // 8], both packed along N in AWQ's
      interleaved order (nibble i of word j holds column 8j + AWQ_PACK_ORDER[i]); scales fp16 [K // G, N];
      zeros stored as they are.
  GPTQ v1 (AutoGPTQ / GPTQModel's default on disk): qweight int32 [K // 8, N] packed along K (nibble i of row j holds
      k = 8j + i); qzeros int32 [K // G, N // 8] packed along N in plain order, holding zero - 1 (the format's
      off-by-one: a symmetric checkpoint's 8 is stored as 7); scales fp16 [K // G, N]; g_idx int32 [K], the group of
      each input feature. A trivial g_idx (k // G) loads with perm None. An act-order g_idx (desc_act=true) is
      honoured by reordering, not re-quantizing: perm = the input features sorted by group (stable), the packed
      columns taken in that order, so each group is contiguous again and the integers and scales are the
      checkpoint's own. Each group must then hold exactly G features.

Quantization here is round-to-nearest (RTN) per group: asymmetric over [min(w, 0), max(w, 0)] by default (GPTQ's
range, which keeps the zero point in 0..15), symmetric with scale 2·amax/15 and zero 8; either way an element
dequantizes within scale/2 of its value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of the block sits in nibble AWQ_UNPACK_ORDER[c]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # [8] nibble i at bits 4i..4i+3


@dataclass
class Int4Weight:
    """One linear layer's INT4 weight in the internal layout (module docstring)."""

    qweight: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # [N, K // G]
    zeros: torch.Tensor  # [N, K // G]
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 8


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """values: integers 0..15 [R, C] (C % 8 == 0) → int32 [R, C // 8], nibble i of word j holding column 8j + i."""
    rows, cols = values.shape
    nibbles = values.to(torch.int64).reshape(rows, cols // 8, 8) << _SHIFTS.to(values.device)  # [R, C // 8, 8]
    words = nibbles.sum(dim=-1)  # [R, C // 8] in 0..2^32 - 1: the nibbles do not overlap
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed: int32 [R, W] → int32 [R, 8W] in 0..15, the inverse of pack_int4."""
    rows, words = packed.shape
    nibbles = (packed.to(torch.int64)[:, :, None] >> _SHIFTS.to(packed.device)) & 0xF  # [R, W, 8]
    return nibbles.reshape(rows, words * 8).to(torch.int32)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """values: 0..15 [R, C] → int32 [R, C // 8] in AWQ's interleaved nibble order."""
    rows, cols = values.shape
    return pack_int4(values.reshape(rows, cols // 8, 8)[:, :, list(AWQ_PACK_ORDER)].reshape(rows, cols))


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """packed: int32 [R, W] in AWQ's order → int32 [R, 8W] in column order."""
    rows, words = packed.shape
    return unpack_int4(packed).reshape(rows, words, 8)[:, :, list(AWQ_UNPACK_ORDER)].reshape(rows, words * 8)


def round_on_grid(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x rounded to nearest on the asymmetric INT4 grid scale · {−zero, …, 15 − zero} → the integers 0..15, as
    float32 (scale and zero broadcast against x)."""
    return ((x / scale).round() + zero).clamp(0, 15)


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """w: [N, K] → its RTN Int4Weight; scales and zeros in w's dtype (q is computed against the stored scales)."""
    n, k = w.shape
    if group_size % 8 or k % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of 8 dividing K = {k}")
    groups = w.float().reshape(n, k // group_size, group_size)  # [N, K // G, G]
    if symmetric:
        scale = groups.abs().amax(dim=-1) * (2 / 15)  # [N, K // G]
    else:
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)  # [N, K // G] each
        scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(w.dtype)  # an all-zero group: 1
    scale32 = scale.float()
    zero = torch.full_like(scale32, 8.0) if symmetric else (-low / scale32).round().clamp(0, 15)  # [N, K // G]
    return quantize_int4_on(w, scale, zero.to(w.dtype), group_size)


def quantize_int4_on(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4Weight:
    """w: [N, K] rounded to nearest on a given grid: scales [N, K // G] (> 0) and integer zeros [N, K // G] in 0..15
    (quant/clip.py search_grid's) → Int4Weight holding those scales and zeros, as given."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)  # [N, K // G, G]
    q = round_on_grid(groups, scales.float()[..., None], zeros.float()[..., None])  # [N, K // G, G]
    return Int4Weight(pack_int4(q.reshape(n, k)), scales, zeros, group_size)


def _dequantize_packed(w: Int4Weight) -> torch.Tensor:
    """→ [N, K] in the scales' dtype, columns in packed order (input feature perm[k] at column k)."""
    n, k = w.out_features, w.in_features
    q = unpack_int4(w.qweight).reshape(n, k // w.group_size, w.group_size).float()  # [N, K // G, G]
    dense = (q - w.zeros.float()[..., None]) * w.scales.float()[..., None]
    return dense.reshape(n, k).to(w.scales.dtype)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """→ [N, K] in the scales' dtype, columns in input-feature order."""
    dense = _dequantize_packed(w)  # [N, K]
    return dense if w.perm is None else dense[:, torch.argsort(w.perm)]


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x: [M, K] (columns in packed order) → [M, N]: the Triton W4A16 kernel on CUDA (kernels/w4a16.py, the weight
    dequantized in registers), else the reference path (dequantize, then one dense GEMM: the engine's CPU path)."""
    if x.is_cuda:  # imported here: kernel modules load only where Triton runs (kernels/__init__.py)
        from services.gpu_worker.kernels.w4a16 import w4a16_linear

        return w4a16_linear(x.contiguous(), w.qweight, w.scales, w.zeros, w.group_size)
    return F.linear(x, _dequantize_packed(w).to(x.dtype))


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] → [M, N] in x's dtype."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    out = int4_matmul(x, w)
    return out if bias is None else out + bias.to(out.dtype)


def to_awq(w: Int4Weight, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """→ AutoAWQ GEMM tensors {qweight [K, N // 8], qzeros [K // G, N // 8], scales [K // G, N]}."""
    if w.perm is not None:
        raise ValueError("AWQ has no act-order: a permuted weight has no AWQ layout")
    return {
        "qweight": _pack_awq(unpack_int4(w.qweight).t()),
        "qzeros": _pack_awq(w.zeros.round().to(torch.int32).t()),
        "scales": w.scales.t().to(scale_dtype).contiguous(),
    }


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """AutoAWQ GEMM tensors (to_awq's) → Int4Weight, scales and zeros in the checkpoint's scale dtype."""
    q = _unpack_awq(qweight)  # [K, N]
    _check_groups(q.shape[0], scales.shape[0], group_size)
    zeros = _unpack_awq(qzeros).t().to(scales.dtype)  # [N, K // G]
    return Int4Weight(pack_int4(q.t()), scales.t().contiguous(), zeros.contiguous(), group_size)


def to_gptq(w: Int4Weight, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """→ GPTQ v1 tensors {qweight [K // 8, N], qzeros [K // G, N // 8] (zero - 1), scales [K // G, N], g_idx [K]}."""
    q = unpack_int4(w.qweight)  # [N, K] packed order
    group = torch.arange(w.in_features, device=q.device) // w.group_size  # [K] the group of packed column k
    g_idx = group
    if w.perm is not None:
        q = q[:, torch.argsort(w.perm)]  # input-feature order
        g_idx = torch.empty_like(group).scatter_(0, w.perm, group)
    return {
        "qweight": pack_int4(q).t().contiguous(),
        "qzeros": pack_int4(((w.zeros.round().to(torch.int32) - 1) & 0xF).t()),
        "scales": w.scales.t().to(scale_dtype).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int) -> Int4Weight:
    """GPTQ v1 tensors → Int4Weight; an act-order g_idx becomes perm (module docstring).

    The stored zero is zero - 1 in 4 bits, so it is read as (stored + 1) mod 16: a zero point of 0, which v1
    writes as 15, comes back as 0 (the quantizer never makes 16)."""
    q = unpack_int4(qweight.t().contiguous())  # [N, K] input-feature order
    n, k = q.shape
    _check_groups(k, scales.shape[0], group_size)
    zeros = ((unpack_int4(qzeros) + 1) & 0xF).t().to(scales.dtype).contiguous()  # [N, K // G]
    perm = None if g_idx is None else _act_order_perm(g_idx.to(torch.int64), group_size)
    if perm is not None:
        q = q[:, perm]
    return Int4Weight(pack_int4(q), scales.t().contiguous(), zeros, group_size, perm)


def _act_order_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """g_idx [K] → None where it is k // G, else the input features sorted by group (stable); ValueError where a
    group does not hold exactly G features."""
    trivial = torch.arange(g_idx.numel(), device=g_idx.device) // group_size  # [K]
    if torch.equal(g_idx, trivial):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], trivial):
        raise ValueError(f"g_idx does not put exactly {group_size} input features in each group")
    return perm


def _check_groups(k: int, num_groups: int, group_size: int) -> None:
    if num_groups * group_size != k:
        raise ValueError(f"{num_groups} groups of {group_size} do not cover K = {k}")
