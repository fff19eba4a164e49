"""The CUDA forward of LlamaForCausalLM: fused q/k/v and gate/up projections (cuBLAS) around the Triton
RMSNorm(+residual), RoPE(+KV write) and SiLU·mul kernels. Same function as the torch forward, up to bf16 rounding.

At up to 32 tokens (decode steps of small batches) o_proj and down_proj run split-K: a strided batched cuBLAS GEMM
over SPLIT_K_PARTS slices of K with fp32 outputs, whose sum the next RMSNorm kernel takes (kernels/rms_norm.py).
At M = 1 on the H200 that is 11.5 µs against F.linear's 13.9 µs for o_proj and 30.4 against 32.6 µs for down_proj:
cuBLAS's own choice for these shapes leaves SMs idle and adds a reduce kernel of its own.

With model.gemv_max_tokens > 0 (EngineConfig.gemv_max_tokens: 1 by default on one CUDA GPU), steps of at most that
many tokens run their four projections and the LM head on the Triton GEMV (kernels/gemv.py) instead of cuBLAS: the
same function, o_proj and down_proj as gemv.ROW_PARTS split-K partials for the next RMSNorm.

Under tensor parallelism (model.tp set) the projections hold this rank's heads and MLP share, and the
o_proj and down_proj outputs are summed over the ranks before the next RMSNorm+residual.

A mixture-of-experts layer (Mixtral, Qwen3-MoE) keeps its own MLP module (model/moe.py: the router, then the fused
Triton MoE kernel on CUDA) between the same Triton norms; its attention is fused as above.

Quantized linear layers (quant/linear.py's QuantizedLinear: FP8 W8A8, INT4 W4A16) run their own GEMMs in the same
places: q/k/v and gate/up are concatenated into one quantized layer each (one activation quantization and one GEMM
instead of three or two), and every projection calls the layer, never the dense GEMV or split-K."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.kernels import gemv as triton_gemv
from services.gpu_worker.kernels import pdl
from services.gpu_worker.kernels.embedding import embedding_fed
from services.gpu_worker.kernels.moe_routing import norm_router
from services.gpu_worker.kernels.rms_norm import rms_norm, rms_norm_heads_
from services.gpu_worker.kernels.rope import rope_
from services.gpu_worker.kernels.silu_mul import silu_mul
from services.gpu_worker.kv_cache import KVCache

if TYPE_CHECKING:
    from services.gpu_worker.parallel.state import TensorParallelGroup

SPLIT_K_PARTS = 4
# the default of model.split_k_max_tokens (0: never split). H200 graph replay of the whole forward, split-K over
# F.linear: 0.976 at 1 token, 0.967-0.976 at 2 to 32, 0.993 at 64
SPLIT_K_MAX_TOKENS = 32


Projection = torch.Tensor | nn.Module  # a dense weight [N, K], or a quantized layer that computes x Wᵀ (+ b) itself


def fuse_projections(model: nn.Module) -> None:
    """Concatenate q/k/v (and gate/up) weights into one matrix each; the original parameters become views
    of it, so no memory is doubled and the HF parameter names still address the same numbers. Quantized layers are
    concatenated into one QuantizedLinear the same way (_concat_quantized)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        if _is_quantized(attn.q_proj):
            _set_unregistered(attn, "qkv_weight", _concat_quantized(qkv))
            attn.qkv_bias = None  # inside the quantized layer
        else:
            attn.qkv_weight = _concat(qkv, "weight")  # [(H + 2 KVH) * D, hidden]
            attn.qkv_bias = _concat(qkv, "bias") if attn.q_proj.bias is not None else None
        if _is_moe(mlp):  # experts are stacked already (model/moe.py)
            continue
        gate_up = (mlp.gate_proj, mlp.up_proj)
        if _is_quantized(mlp.gate_proj):
            _set_unregistered(mlp, "gate_up_weight", _concat_quantized(gate_up))
        else:
            mlp.gate_up_weight = _concat(gate_up, "weight")  # [2 I, hidden]


def _is_moe(mlp: nn.Module) -> bool:
    return hasattr(mlp, "experts")


def _is_quantized(linear: nn.Module) -> bool:
    return not isinstance(getattr(linear, "weight", None), torch.Tensor)  # QuantizedLinear keeps buffers instead


def _concat(linears: tuple[nn.Linear, ...], name: str) -> torch.Tensor:
    fused = torch.cat([getattr(lin, name).data for lin in linears])
    offset = 0
    for lin in linears:
        param = getattr(lin, name)
        rows = param.shape[0]
        param.data = fused[offset: offset + rows]
        offset += rows
    return fused


def _set_unregistered(module: nn.Module, name: str, layer: nn.Module) -> None:
    """module.name = layer without registering it as a child: its buffers are the original layers' own (views), so
    state_dict() and named_buffers() list each number once, under its checkpoint name."""
    object.__setattr__(module, name, layer)


def _concat_quantized(linears: tuple[nn.Module, ...]) -> nn.Module:
    """QuantizedLinear layers of one input (q/k/v, gate/up) → one whose output is theirs side by side; each original
    buffer becomes a view of the fused one. Layers that cannot share one GEMM (different methods, group sizes or
    INT4 act-order permutations) are run one by one and their outputs concatenated."""
    from services.gpu_worker.quant.linear import QuantizedLinear

    first = linears[0]
    same_perm = all((lin.perm is None and first.perm is None) or
                    (lin.perm is not None and first.perm is not None and torch.equal(lin.perm, first.perm))
                    for lin in linears) if first.method == "int4" else True
    if not same_perm or any(lin.method != first.method or lin.group_size != first.group_size for lin in linears):
        return _Concatenated(linears)
    names = ("qweight", "weight_scale") if first.method == "fp8" else ("qweight", "scales", "zeros")
    tensors = {name: _concat(linears, name) for name in names}  # [ΣN, ...] each
    if first.method == "int4":
        tensors["perm"] = first.perm
    some = next((lin.bias for lin in linears if lin.bias is not None), None)
    bias = None if some is None else torch.cat([
        lin.bias if lin.bias is not None else some.new_zeros(lin.out_features) for lin in linears])
    return QuantizedLinear(first.method, first.in_features, sum(lin.out_features for lin in linears), tensors,
                           bias, first.group_size)


class _Concatenated(nn.Module):
    """Layers of one input whose outputs are concatenated, each running its own GEMM."""

    def __init__(self, linears: tuple[nn.Module, ...]) -> None:
        super().__init__()
        self.linears = linears  # a tuple, not a ModuleList: not registered (see _set_unregistered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin(x) for lin in self.linears], dim=-1)


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
            meta: AttentionMetadata, backend: AttentionBackend,
            fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """input_ids, positions: [T] int32/int64 → hidden [T, hidden] after the final norm.

    fed = (src [T], prev): row i's input token is prev[src[i]] where src[i] ≥ 0 (kernels/embedding.py).
    A step of only our kernels (model.runs_only_our_kernels) launches them with PDL where the GPU has it."""
    with pdl.scope(model.runs_only_our_kernels(input_ids.shape[0])):
        return _forward(model, input_ids, positions, cache, meta, backend, fed)


def _forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             meta: AttentionMetadata, backend: AttentionBackend,
             fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    eps = model.config.rms_norm_eps
    if fed is None:
        h = model.model.embed_tokens(input_ids)  # [T, hidden]
    else:
        h = embedding_fed(model.model.embed_tokens.weight, input_ids, fed[0], fed[1])
    residual = None
    num_tokens = input_ids.shape[0]
    num_parts = SPLIT_K_PARTS if model.tp is None and num_tokens <= model.split_k_max_tokens else 1
    gemv = 0 < num_tokens <= model.gemv_max_tokens  # the projections on the Triton GEMV (kernels/gemv.py)
    if gemv:
        num_parts = triton_gemv.ROW_PARTS if model.tp is None else 1
    for layer in model.model.layers:
        x, residual = rms_norm(h, layer.input_layernorm.weight, eps, residual)
        h = _attention(layer.self_attn, x, positions, model.inv_freq, cache, meta, backend, num_parts, gemv)
        if _is_moe(layer.mlp):
            router = layer.mlp.norm_router_weight(residual)
            if router is None:
                x, residual = rms_norm(h, layer.post_attention_layernorm.weight, eps, residual)
                logits = None
            else:  # the norm and the router's logits in one launch
                x, residual, logits = norm_router(h, residual, layer.post_attention_layernorm.weight, eps, router)
            h = layer.mlp(x, logits)  # [T, hidden]: routed experts (summed over the TP ranks inside)
            continue
        x, residual = rms_norm(h, layer.post_attention_layernorm.weight, eps, residual)
        gate_up = _column_projection(x, layer.mlp.gate_up_weight, None, gemv)  # [T, 2 I] (I: this rank's share)
        h = _reduce(_row_projection(silu_mul(gate_up), layer.mlp.down_proj, num_parts, gemv), layer.mlp.tp)
    out, _ = rms_norm(h, model.model.norm.weight, eps, residual)
    return out


def _column_projection(x: torch.Tensor, weight: Projection, bias: torch.Tensor | None,
                       gemv: bool) -> torch.Tensor:
    """x [T, K] @ weight [N, K]ᵀ (+ bias) → [T, N] in x's dtype, on cuBLAS or (gemv) the Triton GEMV; a quantized
    layer runs its own GEMM (its bias inside)."""
    if isinstance(weight, nn.Module):
        return weight(x)
    return triton_gemv.gemv(x, weight, bias) if gemv else F.linear(x, weight, bias)


def _row_projection(x: torch.Tensor, linear: nn.Module | torch.Tensor, num_parts: int, gemv: bool) -> torch.Tensor:
    """x [T, K] @ the weight [N, K]ᵀ (a dense weight, or a layer's) → [T, N]; num_parts > 1: split-K partials
    [S, T, N] fp32 for rms_norm to sum (whole rows where num_parts does not divide K); on cuBLAS or (gemv) the Triton
    GEMV. A quantized layer runs its own GEMM, whole rows."""
    if isinstance(linear, nn.Module) and _is_quantized(linear):
        return linear(x)
    weight = linear if isinstance(linear, torch.Tensor) else linear.weight
    if gemv:
        return triton_gemv.gemv(x, weight, parts=1 if x.shape[1] % num_parts else num_parts)
    if num_parts == 1 or x.shape[1] % num_parts:
        return F.linear(x, weight)
    (num_tokens, k), n = x.shape, weight.shape[0]
    xs = x.view(num_tokens, num_parts, k // num_parts).transpose(0, 1)  # [S, T, K/S] view
    ws = weight.view(n, num_parts, k // num_parts).permute(1, 2, 0)  # [S, K/S, N] view: no copy of the weight
    if not x.is_cuda:  # bmm's out_dtype is CUDA-only (the CPU runs this path under Triton's interpreter)
        return torch.bmm(xs.float(), ws.float())
    return torch.bmm(xs, ws, out_dtype=torch.float32)


def _attention(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend, num_parts: int,
               gemv: bool) -> torch.Tensor:
    num_tokens = x.shape[0]
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = _column_projection(x, attn.qkv_weight, attn.qkv_bias, gemv)
    qkv = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    q = qkv[:, :num_heads]  # [T, H, D] views
    k = qkv[:, num_heads: num_heads + num_kv_heads]  # [T, KVH, D]
    v = qkv[:, num_heads + num_kv_heads:]  # [T, KVH, D]
    if hasattr(attn, "q_norm"):  # Qwen3: q and k normed in place, one launch
        rms_norm_heads_(qkv[:, :num_heads + num_kv_heads], attn.q_norm.weight, attn.k_norm.weight, num_heads,
                        attn.q_norm.eps)
    if hasattr(backend, "forward_rope"):  # the Triton backend: RoPE inside the KV write (decode: the attention)
        out = backend.forward_rope(attn.layer, q, k, v, positions, inv_freq, cache, meta, attn.spec)  # [T, H, D]
    else:
        rope_(q, k, positions, inv_freq)
        out = backend.forward(attn.layer, q, k, v, cache, meta, attn.spec)  # [T, H, D]
    out = _row_projection(out.reshape(num_tokens, num_heads * head_dim), attn.o_proj, num_parts, gemv)
    return _reduce(out, attn.tp)


def _reduce(partial: torch.Tensor, tp: TensorParallelGroup | None) -> torch.Tensor:
    """Row-parallel projection output [T, hidden]: summed over the TP ranks (as it is without TP)."""
    return partial if tp is None else tp.all_reduce(partial)
