"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, and the top k at each
position, computed from a prefill chunk's hidden states (the LM head and log-softmax over row slices, so a long
prompt never holds all its logits at once), brought to the host without stalling the device queue.

    prompt:     t0   t1   t2   t3   t4
    position:   0    1    2    3    4        logits at position p give token p + 1
    slots:      -   [0]  [1]  [2]  [3]       slot p holds t(p + 1)'s logprob; t0 has none
                                              (the last position's logits sample the first output token)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.gpu_worker.request import TokenLogprob

MAX_SLICE_BYTES = 64 << 20  # fp32 logits of one slice of rows (the log-softmax holds a second copy)


@dataclass(eq=False)
class PromptLogprobs:
    """One prompt's logprobs as prefill chunks compute them: slot p is prompt token p + 1's (None until computed).

    Shared by a request's n samples; only the first computes it (the others start from its prompt pass)."""

    num_top: int
    slots: list[TokenLogprob | None]
    num_filled: int = 0

    @classmethod
    def for_prompt(cls, num_prompt_tokens: int, num_top: int) -> PromptLogprobs:
        return cls(num_top, [None] * max(num_prompt_tokens - 1, 0))

    @property
    def is_complete(self) -> bool:
        return self.num_filled == len(self.slots)

    def num_leading(self) -> int:
        """How many slots from the first are filled: positions whose logits are no longer needed."""
        if self.is_complete:
            return len(self.slots)
        return self.slots.index(None)

    def needs(self, position: int) -> bool:
        return position < len(self.slots) and self.slots[position] is None

    def fill(self, position: int, logprob: TokenLogprob) -> None:
        if self.slots[position] is None:
            self.num_filled += 1
        self.slots[position] = logprob

    def as_output(self) -> list[TokenLogprob | None]:
        """One entry per prompt token, None for the first (OpenAI's and vLLM's shape)."""
        return [None, *self.slots]


@dataclass
class PromptSpan:
    """Positions [first_position, first_position + num_positions) of one sequence, computed in this step."""

    target: PromptLogprobs
    first_position: int
    num_positions: int


@dataclass
class PromptLogprobBatch:
    """One step's prompt logprobs: per row the chosen token's logprob and rank and the top max-k, on their way to
    the host (pinned copies behind an event on CUDA, as SampledBatch does with tokens)."""

    spans: list[PromptSpan]
    target_ids: list[int]
    tensors: list[torch.Tensor]  # chosen [N] fp32, rank [N] int64, top values [N, k] fp32, top ids [N, k] int64
    event: torch.cuda.Event | None = None
    _is_applied: bool = field(default=False, repr=False)

    @classmethod
    def launch(cls, spans: list[PromptSpan], target_ids: list[int], tensors: list[torch.Tensor]) -> PromptLogprobBatch:
        if tensors[0].device.type != "cuda":
            return cls(spans, target_ids, tensors)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(host, tensors):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(spans, target_ids, host, event)

    def apply(self) -> None:
        """Wait for this step's rows (only this step's) and fill each span's slots; once."""
        if self._is_applied:
            return
        self._is_applied = True
        if self.event is not None:
            self.event.synchronize()
        chosen, rank, top_vals, top_ids = (t.tolist() for t in self.tensors)
        row = 0
        for span in self.spans:
            k = span.target.num_top
            for position in range(span.first_position, span.first_position + span.num_positions):
                top = list(zip(top_ids[row][:k], top_vals[row][:k]))
                span.target.fill(position, TokenLogprob(self.target_ids[row], chosen[row], top, rank[row]))
                row += 1


def slice_rows(vocab_size: int, max_slice_bytes: int = MAX_SLICE_BYTES) -> int:
    """Rows of fp32 logits that fit in max_slice_bytes (at least one)."""
    return max(1, max_slice_bytes // (4 * vocab_size))


@torch.inference_mode()
def prompt_logprob_tensors(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                           target_ids: torch.Tensor, num_top: int, num_slice_rows: int) -> list[torch.Tensor]:
    """hidden [N, H], target_ids [N] → [chosen [N] fp32, rank [N] int64, top values [N, k], top ids [N, k]]:
    log_softmax(logits_of(hidden rows)) at each row's target token, 1 + the tokens above it, and the top num_top;
    num_slice_rows rows at a time. logits_of: the model's LM head ([n, H] → [n, V] fp32)."""
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for start in range(0, hidden.shape[0], num_slice_rows):
        logprobs = logits_of(hidden[start:start + num_slice_rows]).float().log_softmax(dim=-1)  # [n, V] fp32
        target = target_ids[start:start + num_slice_rows].unsqueeze(1)  # [n, 1]
        picked = logprobs.gather(1, target)  # [n, 1]
        chosen.append(picked.squeeze(1))
        ranks.append((logprobs > picked).sum(dim=1) + 1)  # [n] int64
        values, ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [n, k]
        top_vals.append(values)
        top_ids.append(ids)
    return [torch.cat(chosen), torch.cat(ranks), torch.cat(top_vals), torch.cat(top_ids)]
