"""Activation-aware weight scaling for INT4 (AWQ: Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for
LLM Compression and Acceleration"), written from the paper's method: before round-to-nearest, each input channel k
of a linear layer is multiplied by s_k and its input divided by s_k, y = (x / s) (W · diag s)ᵀ, exact in float. The
division folds into the op that produced x, so nothing runs at serving time:

    q/k/v_proj   ← input_layernorm's weight           gate/up_proj ← post_attention_layernorm's weight
    down_proj    ← up_proj's rows (f(gate) · up is linear in up)
    o_proj       ← v_proj's rows (attention output is linear in v; under GQA a query head's channel takes its kv
                   head's factor, so the query heads of one kv group share one set)

s = mean|x_k|^α over calibration tokens; α is searched on a grid in [0, 1] per group of layers that share one input,
minimizing Σ ‖x Wᵀ − (x / s) Q(W · diag s)ᵀ‖² over the calibration rows (Q: the INT4 RTN the layer will get). α = 0
is s = 1, so on the calibration rows the search never does worse than plain RTN. Salient channels (large |x|) get
larger weights and so finer steps relative to them within their group.

A group is scaled only where the fold is exact: the norm is the Llama RMSNorm (weight · x̂; Gemma's (1 + w) is not a
plain multiplier), the MLP multiplies a gate by up_proj, the attention has v_proj and o_proj as plain nn.Linear.
Layers that do not match (fused or routed-expert MLPs) keep s = 1. The float model's output stays the same.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby

import torch
from torch import nn

from services.gpu_worker.model.llama import RMSNorm
from services.gpu_worker.quant.clip import GRAM_SHRINK, search_grid, shrunk_gram
from services.gpu_worker.quant.gptq import gptq_quantize_on_grid, one_cpu_thread
from services.gpu_worker.quant.int4 import Int4Weight, dequantize_int4, quantize_int4
from services.gpu_worker.quant.linear import int4_group_size
from services.gpu_worker.quant.quality import LayerDone, run_until_done

ALPHA_GRID = tuple(i / 20 for i in range(21))
GRID_GPTQ_DAMP = 0.1
"""GPTQ's damping on the writer's fixed grids, λ = 0.1 · mean(diag H) (GPTQ's usual 0.01 fitted the 1,024 calibration
tokens more: +10.0 % against +8.6 % perplexity on the bundled model with GRAM_SHRINK 0.3)."""


@dataclass
class ScaleGroup:
    """Linears that read one input x [T, K], and the op whose output x is: `prev` (an RMSNorm, or a linear whose
    output rows are x's channels). Channel c of x is prev's channel `tie[c]` (None: c itself)."""

    linears: list[nn.Linear]
    prev: nn.Module
    tie: torch.Tensor | None = None  # int64 [K] → prev channel


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    """The foldable groups of one decoder layer (module docstring), in forward order."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    groups = []
    qkv = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if type(getattr(layer, "input_layernorm", None)) is RMSNorm and all(_is_linear(m) for m in qkv):
        groups.append(ScaleGroup(qkv, layer.input_layernorm))
    if _is_linear(getattr(attn, "v_proj", None)) and _is_linear(getattr(attn, "o_proj", None)):
        group = attn.num_heads // attn.num_kv_heads
        head = torch.arange(attn.num_heads * attn.head_dim) // attn.head_dim  # [H · D] query head of each channel
        dim = torch.arange(attn.num_heads * attn.head_dim) % attn.head_dim
        groups.append(ScaleGroup([attn.o_proj], attn.v_proj, (head // group) * attn.head_dim + dim))
    gate_up = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
    if type(getattr(layer, "post_attention_layernorm", None)) is RMSNorm and all(_is_linear(m) for m in gate_up):
        groups.append(ScaleGroup(gate_up, layer.post_attention_layernorm))
    if all(_is_linear(m) for m in gate_up) and _is_linear(getattr(mlp, "down_proj", None)):
        groups.append(ScaleGroup([mlp.down_proj], mlp.up_proj))
    return groups


def _is_linear(module: nn.Module | None) -> bool:
    return type(module) is nn.Linear


def int4_rtn(group_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The INT4 round-to-nearest a layer gets on load, as a float function: w [N, K] → dequantized [N, K] float32."""
    return lambda w: dequantize_int4(quantize_int4(w, int4_group_size(w.shape[1], group_size))).float()


@torch.no_grad()
def search_scale(x: torch.Tensor, weights: list[torch.Tensor], quantize: Callable[[torch.Tensor], torch.Tensor],
                 tie: torch.Tensor | None = None, shrink: float = 0.0) -> tuple[torch.Tensor, float]:
    """x: float32 [T, K]; weights: float32 [N_i, K] each → (s float32 [P] in prev's channels, the best α).

    The error of a candidate, ‖x Wᵀ − (x / s) Q(W · diag s)ᵀ‖² = Σ_n Δ_n (xᵀx) Δ_nᵀ with Δ = Q(W · diag s) / s − W,
    is computed through the Gram matrix xᵀx [K, K], once per group: its cost does not grow with T. `shrink` > 0
    scores through quant/clip.py's shrunk_gram instead (the writer's path)."""
    mean = x.abs().mean(dim=0)  # [K]
    if tie is not None:  # the mean over the channels that share a prev channel
        mean = torch.zeros(int(tie.max()) + 1, device=mean.device).index_add_(0, tie, mean) / torch.bincount(tie)
    gram = x.T @ x  # [K, K]
    if shrink:
        gram = shrunk_gram(gram, shrink)
    best = (float("inf"), torch.ones_like(mean), 0.0)
    for alpha in ALPHA_GRID:
        s = mean.clamp(min=1e-5) ** alpha  # [P]
        s = s / (s.max() * s.min()).sqrt()  # centred on 1 in log space; the fold is exact at any overall factor
        full = s if tie is None else s[tie]  # [K]
        error = 0.0
        for w in weights:
            delta = quantize(w * full) / full - w  # [N, K]
            error += ((delta @ gram) * delta).sum().item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def fold_scale_(group: ScaleGroup, s: torch.Tensor) -> None:
    """x / s into `prev`, W · diag s into each linear: the group's float output unchanged."""
    full = s if group.tie is None else s[group.tie.to(s.device)]  # [K]
    for linear in group.linears:
        linear.weight.mul_(full.to(linear.weight))
    if isinstance(group.prev, nn.Linear):
        group.prev.weight.div_(s.to(group.prev.weight)[:, None])
        if group.prev.bias is not None:
            group.prev.bias.div_(s.to(group.prev.bias))
    else:
        group.prev.weight.div_(s.to(group.prev.weight))


def scale_activation_aware_(model: nn.Module, token_batches: list[list[int]], group_size: int = 128,
                            on_group: Callable[[int, float], None] | None = None,
                            grids: dict[nn.Linear, Int4Weight] | None = None) -> list[float]:
    """Search and fold s for every foldable group of every decoder layer of `model` (model.model.layers) on
    `token_batches` run as sequence_logits runs them; → the α chosen for each group, in order. on_group(decoder
    layer index, α) after each group is folded. Given a `grids` dict (`radixserve quantize` only: serving's on-load
    path passes none), α is searched through quant/clip.py's shrunk Gram matrix, and once a decoder layer's groups
    are all folded (a later group's fold rescales v_proj's and up_proj's rows), each of its grouped linears gets its
    INT4 weight, grids[linear]: its groups' grids chosen by quant/clip.py search_grid and its integers on them by
    GPTQ's error feedback (quant/gptq.py gptq_quantize_on_grid), both through the shrunk Gram matrix of its scaled
    inputs x / s.

    One forward per sequence collects every group's input before any fold: a fold leaves the float model's output,
    and so every other group's input, unchanged (module docstring), and changes only its own group's, which the
    search accounts for."""
    layer_of = [i for i, layer in enumerate(model.model.layers) for _ in scale_groups(layer)]
    groups = [group for layer in model.model.layers for group in scale_groups(layer)]
    if not groups:
        return []
    inputs: list[list[torch.Tensor]] = [[] for _ in groups]

    def hook(index: int):
        def record(module: nn.Module, args: tuple) -> None:
            inputs[index].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
            if index == len(groups) - 1:
                raise LayerDone  # the LM head is not needed
        return record

    handles = [g.linears[0].register_forward_pre_hook(hook(i)) for i, g in enumerate(groups)]
    run_until_done(model, token_batches, handles)
    alphas = []
    quantize = int4_rtn(group_size)
    shrink = 0.0 if grids is None else GRAM_SHRINK
    for layer_index, members in groupby(zip(layer_of, groups, inputs), key=lambda member: member[0]):
        pending: list[tuple[nn.Linear, torch.Tensor]] = []  # this decoder layer's linears and their inputs' Gram
        for _, group, xs in members:
            if not xs:
                continue
            x = torch.cat(xs)  # [T, K]
            weights = [linear.weight.detach().float() for linear in group.linears]
            # NOTE: on one CPU thread. The bundled model's on-load search (serve --quantization awq) on 2 cores took
            # 26 s on 2 threads and 49 s on one when quiet, but 260 s against 55 s beside another busy 2-thread job
            with one_cpu_thread(x.device):
                s, alpha = search_scale(x, weights, quantize, None if group.tie is None else group.tie.to(x.device),
                                        shrink)
            fold_scale_(group, s)
            if grids is not None:
                scaled = x / (s if group.tie is None else s[group.tie.to(s.device)])  # [T, K] the linears' input now
                gram = shrunk_gram(scaled.T @ scaled)
                pending.extend((linear, gram) for linear in group.linears)
            alphas.append(alpha)
            xs.clear()
            if on_group is not None:
                on_group(layer_index, alpha)
        for linear, gram in pending:  # the layer's folds are all done: its weights are final
            w = linear.weight.detach().float()  # [N, K]
            size = int4_group_size(w.shape[1], group_size)
            scales, zeros = search_grid(w, gram, size)
            grids[linear] = gptq_quantize_on_grid(w, gram, scales, zeros, size, damp=GRID_GPTQ_DAMP)
    return alphas
