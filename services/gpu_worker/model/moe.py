"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax top-k router over SwiGLU experts.

On CUDA the experts run on kernels/fused_moe.py: the (token, expert) pairs sorted by expert on the device, a
grouped Triton GEMM over the experts that were hit and the top-k combine, with no host sync, so the same path runs
eagerly and under CUDA graph capture; a decode step of few tokens takes kernels/moe_gemv.py instead (each pair a
matrix-vector product, the combine folded into the down pass). The router's softmax and top-k there are one kernel
(kernels/moe_routing.py); its logits, in such a step, come from the post-attention RMSNorm's launch
(moe_routing.norm_router, called by model/fused.py), else at one token from the Triton GEMV.
The torch path, the CPU's and the kernel's reference in the tests, groups the tokens by expert: the T·k (token,
expert) pairs are sorted by expert, each expert that was hit runs one GEMM pair over its contiguous rows, and the
weighted rows are summed back per token (index_add_). The loop is over experts, never over tokens; the group sizes
are read on the host (one sync per layer).

Parameter names follow transformers 5's fused layout, which `moe_families.py` builds from per-expert checkpoints:

    mlp.gate.weight                [E, hidden]          the router
    mlp.experts.gate_up_proj       [E, 2 I, hidden]     gate rows first, then up
    mlp.experts.down_proj          [E, hidden, I]
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.model.config import ModelConfig

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.use_fused: bool | None = None  # the Triton kernels; None: on CUDA (tests set it on the CPU's interpreter)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] through expert e's SwiGLU → [N, hidden]."""
        gate, up = F.linear(x, self.gate_up_proj[e]).split(self.intermediate_size, dim=-1)  # [N, I] each
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; top_ids, top_weights: [T, k] → Σ_j top_weights[t, j] · expert_{top_ids[t, j]}(x[t])."""
        use_fused = x.is_cuda if self.use_fused is None else self.use_fused
        if use_fused:
            from services.gpu_worker.kernels.fused_moe import fused_moe  # imports triton

            return fused_moe(x, self.gate_up_proj, self.down_proj, top_ids, top_weights)
        return self._grouped(x, top_ids, top_weights)

    def _grouped(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        num_experts = self.gate_up_proj.shape[0]
        k = top_ids.shape[1]
        flat_ids = top_ids.flatten()  # [T·k]: pair p is token p // k's j = p % k choice
        order = torch.argsort(flat_ids, stable=True)  # [T·k] pairs grouped by expert
        tokens = order // k  # [T·k] the token of each sorted pair
        counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # host sync: the group sizes
        rows = x[tokens]  # [T·k, hidden]
        out_rows = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                out_rows[start: start + count] = self.expert(e, rows[start: start + count])
                start += count
        out_rows *= top_weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out_rows)  # [T, hidden]


class SparseMoe(nn.Module):
    """Router + experts: softmax over all experts in fp32, the top k kept (renormalised to sum 1 when
    cfg.norm_topk_prob), each token's output the weighted sum of its k experts' outputs.

    Under tensor parallelism (tp) every rank routes alike (the router is replicated) and holds each expert's
    moe_intermediate_size / tp share (parallel/shard.py), so every rank computes every routed pair on its share and
    the partial outputs are summed over the ranks, as the dense MLP's are."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        share = cfg.moe_intermediate_size // (1 if tp is None else tp.size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, share)

    def _routes_on_kernels(self, x: torch.Tensor) -> bool:
        use_fused = x.is_cuda if self.experts.use_fused is None else self.experts.use_fused
        return use_fused and self.top_k & (self.top_k - 1) == 0

    def norm_router_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The router's weight when a step of x's tokens computes the logits inside the post-attention RMSNorm's
        launch (kernels/moe_routing.norm_router; model/fused.py calls it): decode steps of at most
        fused_moe.GEMV_MAX_TOKENS tokens on the kernels, a plain router in x's dtype. Else None."""
        if not self._routes_on_kernels(x):
            return None
        from services.gpu_worker.kernels.fused_moe import GEMV_MAX_TOKENS  # imports triton

        weight = self.gate.weight
        if (x.shape[0] <= GEMV_MAX_TOKENS and type(self.gate) is nn.Linear and self.gate.bias is None
                and weight.dtype == x.dtype):
            return weight
        return None

    def route(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] → top_ids [T, k] int64, top_weights [T, k] fp32. logits: the router's [T, E] when the
        caller computed them (norm_router)."""
        if self._routes_on_kernels(x):  # one Triton launch (kernels/moe_routing.py)
            from services.gpu_worker.kernels.gemv import gemv  # imports triton
            from services.gpu_worker.kernels.moe_routing import route_topk

            # one token: the router's E × hidden weight on the Triton GEMV, 2.67 µs against cuBLAS's 5.32 on an H100
            # for Qwen3-30B-A3B's 128 × 2048 (bench/kernel_table.py --moe-gemv-sweep)
            if logits is None:
                logits = gemv(x, self.gate.weight) if x.shape[0] == 1 else self.gate(x)
            return route_topk(logits, self.top_k, self.normalize)
        assert logits is None, "given logits are taken on the kernels' path only"
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E] fp32
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_ids, top_weights

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        top_ids, top_weights = self.route(x, logits)
        out = self.experts(x, top_ids, top_weights)  # [T, hidden]
        return out if self.tp is None else self.tp.all_reduce(out)  # TP: the sum over the intermediate shares
