"""Measuring a quantized model against its float original: teacher-forced logits of one token sequence (one
prefill on a fresh paged cache, the reference attention), perplexity and top-1 agreement.

Teacher forcing keeps the two models on the same inputs at every position, so their logits compare row by row;
a generated continuation would drift apart at the first flipped token and compare nothing after it.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttentionMetadata, TorchAttention
from services.gpu_worker.kv_cache import KVCache


@torch.inference_mode()
def sequence_logits(model: nn.Module, token_ids: list[int], page_size: int = 16) -> torch.Tensor:
    """The logits after each token of one sequence, [T, V] fp32, from a LlamaForCausalLM-like model (forward over a
    paged cache, logits()); page 0 stays the cache's reserved padding page."""
    cfg = model.config
    device, dtype = model.model.embed_tokens.weight.device, model.model.embed_tokens.weight.dtype
    num_tokens = len(token_ids)
    num_pages = -(-num_tokens // page_size)
    cache = KVCache(cfg.num_layers, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(page_size, page_size + num_tokens, device=device),  # pages 1.. in order
        query_start=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        page_table=torch.arange(1, num_pages + 1, dtype=torch.int32, device=device)[None],  # [1, pages]
        query_start_host=[0, num_tokens], seq_lens_host=[num_tokens],
        max_query_len=num_tokens, max_seq_len=num_tokens)
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), cache, meta, TorchAttention())  # [T, hidden]
    return model.logits(hidden)  # [T, V]


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1..T-1, each under the logits [T, V] of the one before."""
    targets = torch.tensor(token_ids[1:], device=logits.device)
    return math.exp(F.cross_entropy(logits[:-1].float(), targets).item())


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of rows of two [T, V] logits whose argmax agree."""
    return (logits.argmax(dim=-1) == reference.argmax(dim=-1)).float().mean().item()


class LayerDone(Exception):
    """Raised by a calibration hook once the layer it calibrates has seen a sequence's inputs: the rest of that
    forward is not needed."""


def run_until_done(model: nn.Module, token_batches: list[list[int]], handles: list,
                   on_sequence: Callable[[], None] | None = None) -> None:
    """Each sequence of token_batches through `model` as sequence_logits runs it, each forward stopped where a hook
    raises LayerDone (on_sequence called before each); the hooks' `handles` removed after, whatever happens."""
    try:
        for tokens in token_batches:
            if on_sequence is not None:
                on_sequence()
            try:
                sequence_logits(model, tokens)
            except LayerDone:
                pass
    finally:
        for handle in handles:
            handle.remove()
