"""Calibrated INT4 and FP8 weight quantization: GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers"), written from the paper's algorithm.

Per linear layer y = x Wᵀ with calibration inputs X [T, K], the layer's output error ‖X Wᵀ − X Ŵᵀ‖² is a quadratic
in each row of W with Hessian H = 2 XᵀX. The columns of W are quantized one at a time, left to right; each column's
rounding error, divided by the matching diagonal entry of the upper Cholesky factor U of H⁻¹, is spread onto the
not-yet-quantized columns through that row of U, so they absorb what the rounding lost. Updates are applied lazily
in blocks of columns (the paper's batching: exact, only faster). H gets λ = damp · mean(diag H) added to its diagonal
first; an input feature that was never nonzero (diag H = 0) gets diag 1 and its weights zeroed (nothing ever reads
them).

The grid is quantize_int4's asymmetric one (range [min(w, 0), max(w, 0)], 15 steps, integer zero point), per group of
G consecutive processed columns; a group's scale and zero are fixed when the quantizer reaches its first column, from
the columns as the error feedback has left them by then. The result is an ordinary Int4Weight: dequantize_int4 and
int4_linear read it unchanged.

The same error feedback picks FP8 weights (gptq_quantize_fp8): the grid is quantize_weight_fp8's, e4m3 with one scale
per output row mapping the row's amax to 448, fixed before the first column; the result is an ordinary (qweight,
weight_scale) pair, so fp8_linear and torch._scaled_mm on the GPU read it unchanged. e4m3 keeps ~3 significant bits
at every magnitude, so its rounding error is relative, and on the bundled model it is the weights' FP8 error that
the feedback reduces (docs/PERFORMANCE.md, quality).

act_order processes the input features by descending diag H (the most-used first, while the most columns remain to
absorb their error). Groups are then groups of processed columns, so the result carries perm (packed column k holds
input feature perm[k]); within a group the features are put back in ascending order (a group's scale and zero do not
depend on the order inside it), which is the order GPTQ v1's g_idx reads back in, so to_gptq / from_gptq round trips
it exactly.

calibrate_gptq_ quantizes a model sequentially, one decoder layer at a time: the Hessians of layer i's linears are
collected from the model with layers 0..i−1 already quantized (the forward stops once layer i's linears have seen
their inputs), so each layer corrects the error of those before it.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from services.gpu_worker.quant.fp8 import (FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_activation_fp8,
                                          quantize_weight_fp8)
from services.gpu_worker.quant.int4 import Int4Weight, pack_int4, quantize_int4, round_on_grid
from services.gpu_worker.quant.linear import LinearMethod, QuantizedLinear, int4_group_size
from services.gpu_worker.quant.quality import LayerDone, run_until_done
from services.gpu_worker.quant.targets import linear_targets


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, act_order: bool = False,
                  damp: float = 0.01, block: int = 128) -> Int4Weight:
    """w: [N, K]; hessian: [K, K] (2 XᵀX of the layer's inputs, any positive scale) → Int4Weight, scales and zeros
    in w's dtype (as quantize_int4's)."""
    n, k = w.shape
    if group_size % 8 or k % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of 8 dividing K = {k}")
    weight, u, perm = _prepared(w, hessian, act_order, damp)
    q = torch.zeros(n, k, dtype=torch.int64, device=w.device)
    scales = torch.zeros(n, k // group_size, dtype=w.dtype, device=w.device)
    zeros = torch.zeros(n, k // group_size, dtype=w.dtype, device=w.device)

    def round_column(column: int, rest: torch.Tensor) -> torch.Tensor:
        g = column // group_size
        if column % group_size == 0:  # the group's grid from its columns as the feedback has left them
            grid = quantize_int4(rest[:, :group_size].to(w.dtype), group_size)
            scales[:, g], zeros[:, g] = grid.scales[:, 0], grid.zeros[:, 0]
        return _round_column_(q, column, rest, scales[:, g].float(), zeros[:, g].float())

    _feedback_quantize_(weight, u, max(block // group_size, 1) * group_size, round_column)  # a group in one block
    if perm is not None:  # ascending input features within each group: v1 g_idx's order
        within = torch.argsort(perm.reshape(-1, group_size), dim=1)  # [K // G, G]
        order = (within + torch.arange(0, k, group_size, device=w.device)[:, None]).reshape(k)
        perm, q = perm[order], q[:, order]
    return Int4Weight(pack_int4(q), scales, zeros, group_size, perm)


@torch.no_grad()
def gptq_quantize_on_grid(w: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, damp: float = 0.01, block: int = 128) -> Int4Weight:
    """w: [N, K]; hessian: [K, K]; scales, zeros [N, K // G]: every group's grid fixed beforehand (quant/clip.py
    search_grid's) → Int4Weight on exactly those grids, each integer chosen by the error feedback in input-feature
    order (no act-order: the AutoAWQ layout has no permutation)."""
    weight, u, _ = _prepared(w, hessian, False, damp)
    q = torch.zeros(weight.shape, dtype=torch.int64, device=w.device)
    scales32, zeros32 = scales.float(), zeros.float()

    def round_column(column: int, rest: torch.Tensor) -> torch.Tensor:
        g = column // group_size
        return _round_column_(q, column, rest, scales32[:, g], zeros32[:, g])

    _feedback_quantize_(weight, u, block, round_column)
    return Int4Weight(pack_int4(q), scales, zeros, group_size)


def _round_column_(q: torch.Tensor, column: int, rest: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                   ) -> torch.Tensor:
    """The INT4 error feedback's step: q[:, column] ← the first column of `rest` (the columns not yet quantized, as
    the feedback has left them) rounded on the grid (scale, zero) [N] float32; → its dequantized values."""
    q[:, column] = round_on_grid(rest[:, 0], scale, zero).to(torch.int64)
    return (q[:, column] - zero) * scale


@torch.no_grad()
def gptq_quantize_fp8(w: torch.Tensor, hessian: torch.Tensor, act_order: bool = True, damp: float = 0.01,
                      block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K]; hessian: [K, K] → (qweight e4m3 [N, K], scale float32 [N]): quantize_weight_fp8's format (each
    row's scale maps its amax to FP8_MAX, fixed before the first column), the e4m3 values chosen by GPTQ's error
    feedback instead of rounding each to nearest. A value the feedback pushes past the row's amax saturates."""
    weight, u, perm = _prepared(w, hessian, act_order, damp)
    _, scale = quantize_weight_fp8(weight)  # [N] from the rows as they enter (dead columns zeroed)
    q = torch.zeros(weight.shape, dtype=FP8_DTYPE, device=w.device)  # [N, K] processed order

    def round_column(column: int, rest: torch.Tensor) -> torch.Tensor:
        q[:, column] = (rest[:, 0] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q[:, column].float() * scale

    _feedback_quantize_(weight, u, block, round_column)
    return (q if perm is None else q[:, torch.argsort(perm)].contiguous()), scale


def _prepared(w: torch.Tensor, hessian: torch.Tensor, act_order: bool, damp: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """→ (w float32 [N, K] with dead input features zeroed, in processed order; the upper Cholesky factor U of the
    damped H⁻¹ [K, K] float32, processed order; perm int64 [K] or None: processed column j is input feature perm[j])."""
    k = w.shape[1]
    weight = w.float().clone()  # [N, K]
    h = hessian.double().clone().to(w.device)  # [K, K]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        weight, h = weight[:, perm], h[perm][:, perm]
    h += torch.eye(k, dtype=h.dtype, device=h.device) * damp * torch.diagonal(h).mean()
    return weight, torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float(), perm


def _feedback_quantize_(weight: torch.Tensor, u: torch.Tensor, block: int,
                        round_column: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """GPTQ's loop over the columns of weight [N, K] (processed order, updated in place): round_column(j, rest)
    quantizes column j given the block's columns from j on (rest [N, ≥1], rest[:, 0] is column j, as the feedback
    has left them) and returns its dequantized value [N]; the rounding error, over U[j, j], moves onto the columns
    after j through row j of U, lazily across blocks."""
    k = weight.shape[1]
    for start in range(0, k, block):
        end = min(start + block, k)
        cols, u_block = weight[:, start:end], u[start:end, start:end]  # cols: a view, updated in place
        errors = torch.zeros_like(cols)  # [N, B]
        with one_cpu_thread(weight.device):
            for i in range(end - start):
                error = (cols[:, i] - round_column(start + i, cols[:, i:])) / u_block[i, i]  # [N]
                cols[:, i:] -= error[:, None] * u_block[i, i:][None, :]
                errors[:, i] = error
        weight[:, end:] -= errors @ u[start:end, end:]


@contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """One intra-op thread on the CPU for loops of small ops (GPTQ's column loop, AWQ's scale search): each op is a
    parallel region whose barrier waits for every thread, so a thread descheduled by another busy process stalls
    every op. On the 2-core CPU shared with other jobs, the bundled model's FP8 calibration took ~55 s a decoder layer
    with 2 threads against ~1 s quiet; one gptq_quantize_fp8 of a [3072, 576] weight at a load of ~3 took 0.35-1.1 s
    with this against 1.1-3.6 s without."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def layer_groups(targets: list[tuple[str, nn.Module, str, nn.Linear]]
                 ) -> list[list[tuple[str, nn.Module, str, nn.Linear]]]:
    """Targets grouped by decoder layer (the qualified name up to its first numeric component, e.g.
    `model.layers.3`; a name without one is its own group), in module order."""
    groups: dict[str, list] = defaultdict(list)
    for target in targets:
        groups[_layer_name(target[0])].append(target)
    return list(groups.values())


def _layer_name(qualified: str) -> str:
    """`model.layers.3.mlp.up_proj` → `model.layers.3`; a name without a numeric component is its own."""
    match = re.match(r"(.*?\.\d+)(\.|$)", qualified)
    return match.group(1) if match else qualified


def calibrate_gptq_(model: nn.Module, token_batches: list[list[int]], group_size: int = 128,
                    act_order: bool = False, skip: tuple[str, ...] = ("lm_head",), damp: float = 0.01,
                    method: LinearMethod = "int4", on_layer: Callable[[str, int], None] | None = None) -> int:
    """Replace each nn.Linear that quantize_linears_ would (not `skip`, not an MoE router) by a GPTQ-quantized
    QuantizedLinear (method "int4": groups of int4_group_size(K, group_size); "fp8": gptq_quantize_fp8, whose
    layers quantize their activations per token, so the next layer calibrates on what W8A8 feeds it), calibrated
    on `token_batches` (each one sequence run as sequence_logits runs it), one decoder layer at a time (module
    docstring); on_layer(layer name, linears quantized in it) after each. → how many."""
    targets = linear_targets(model, skip)
    stand_ins: list = []  # fp8: (parent, name, QuantizedLinear, hook handle) installed at the end
    for group in layer_groups(targets):
        hessians: dict[str, torch.Tensor] = {}
        rows: dict[str, int] = defaultdict(int)
        seen: set[str] = set()

        def hook(qualified: str):
            def accumulate(module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
                x = inputs[0].detach().reshape(-1, module.in_features).double()  # [T, K]
                before, total = rows[qualified], rows[qualified] + x.shape[0]
                h = hessians.setdefault(qualified, torch.zeros(module.in_features, module.in_features,
                                                                dtype=torch.float64, device=x.device))
                h.mul_(before / total).addmm_(x.T, x, alpha=2 / total)  # the running mean of 2 xᵀx
                rows[qualified] = total
                seen.add(qualified)
                if len(seen) == len(group):
                    raise LayerDone
            return accumulate

        handles = [child.register_forward_hook(hook(qualified)) for qualified, _, _, child in group]
        run_until_done(model, token_batches, handles, on_sequence=seen.clear)
        for members in _sharing_inputs(group, hessians):  # q/k/v and gate/up: one run over their stacked rows
            weight = torch.cat([child.weight.detach() for *_, child in members])  # [ΣN, K]
            hessian = hessians.get(members[0][0])
            if hessian is None:  # never ran: H = I, RTN-like
                hessian = torch.eye(weight.shape[1], dtype=torch.float64, device=weight.device)
            rows_each = [child.out_features for *_, child in members]
            if method == "fp8":
                q, scale = gptq_quantize_fp8(weight, hessian, act_order, damp)
                layers = [QuantizedLinear.fp8(qi.contiguous(), si.contiguous(), _bias(child)) for qi, si, (*_, child)
                          in zip(q.split(rows_each), scale.split(rows_each), members)]
            else:
                w = gptq_quantize(weight, hessian, int4_group_size(weight.shape[1], group_size), act_order, damp)
                parts = zip(w.qweight.split(rows_each), w.scales.split(rows_each), w.zeros.split(rows_each))
                layers = [QuantizedLinear.int4(Int4Weight(qw.contiguous(), sc.contiguous(), ze.contiguous(),
                                                          w.group_size, w.perm), _bias(child))
                          for (qw, sc, ze), (*_, child) in zip(parts, members)]
            for (_, parent, name, child), layer in zip(members, layers):
                if method == "fp8":  # same numbers as the layer's CPU forward, without dequantizing at every call
                    child.weight.data = dequantize_fp8(layer.qweight, layer.weight_scale).to(child.weight.dtype)
                    stand_ins.append((parent, name, layer, child.register_forward_pre_hook(_fp8_activations)))
                else:
                    setattr(parent, name, layer)
        if on_layer is not None:
            on_layer(_layer_name(group[0][0]), len(group))
    for parent, name, layer, handle in stand_ins:
        handle.remove()
        setattr(parent, name, layer)
    return len(targets)


def _sharing_inputs(group: list[tuple[str, nn.Module, str, nn.Linear]], hessians: dict[str, torch.Tensor]
                    ) -> list[list[tuple[str, nn.Module, str, nn.Linear]]]:
    """The group's linears in runs of neighbours with the same Hessian (the same inputs, as q/k/v's): GPTQ treats
    each row of W on its own, so quantizing their stacked rows at once gives each the same result."""
    runs: list[list] = []
    for target in group:
        h = hessians.get(target[0])
        prev_h = hessians.get(runs[-1][-1][0]) if runs else None
        if h is not None and prev_h is not None and prev_h.shape == h.shape and torch.equal(prev_h, h):
            runs[-1].append(target)
        else:
            runs.append([target])
    return runs


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


def _fp8_activations(module: nn.Module, args: tuple) -> tuple:
    """A dense stand-in's input quantized per token as fp8_linear quantizes it, and dequantized."""
    x = args[0]
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    return (dequantize_fp8(*quantize_activation_fp8(flat)).to(x.dtype).reshape(x.shape),)
