"""The attention backend contract: what one engine step tells a backend, and what it must compute."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch

from services.gpu_worker.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache. T new tokens over B sequences.

    Sequence i contributes new tokens q[query_start[i]:query_start[i+1]], which sit at positions
    [seq_lens[i] - n_i, seq_lens[i]) of that sequence; each attends causally to positions [0, its own].

        seq i:  |<---- cached prefix ---->|<-- n_i new -->|
                0                seq_lens[i]-n_i     seq_lens[i]
    """

    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset of each new token
    query_start: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step
    page_table: torch.Tensor  # [B, max_pages] int32: page ids, padded with page 0
    query_start_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @cached_property
    def num_leading_single(self) -> int:
        """How many sequences at the front of the batch have exactly one new token (decodes come first)."""
        starts = self.query_start_host
        n = 0
        while n < self.num_seqs and starts[n + 1] - starts[n] == 1:
            n += 1
        return n


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention asks beyond the default (scale 1/sqrt(head_dim), no soft-cap, no window): Gemma 2.

    A query at position i attends to keys j ≤ i, and with a window only to i - sliding_window < j ≤ i."""

    scale: float | None = None  # None: head_dim ** -0.5
    softcap: float | None = None  # logits → softcap · tanh(logits / softcap), before the mask
    sliding_window: int | None = None  # how many positions (its own included) a query sees; None: all

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_ATTENTION


DEFAULT_ATTENTION = LayerAttention()


class AttentionBackend(ABC):
    """Writes the new K/V into the paged cache, then attends each new query to its sequence."""

    name: str = "base"

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata, spec: LayerAttention = DEFAULT_ATTENTION) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] → [T, H, D]. spec: the layer's scale, soft-cap and window."""
