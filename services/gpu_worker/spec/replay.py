"""A benchmark and test proposer, never served: it replays each prompt's known greedy continuation, every draft true
with probability alpha, so verification accepts a set share of drafts whatever the model (random weights included).

Each draft token is the recorded one with probability alpha (seeded) and a wrong one ((true + 1) mod vocab)
otherwise: the verifier accepts a draft at position j with probability alpha given it accepted those before. A
sequence that has left its record (a bf16 near-tie decoded differently from the recorded run) gets no drafts: its
continuation is unknown from there.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from services.gpu_worker.spec.proposer import ProposalRequest


class ReplayProposer:
    """Proposer (proposer.Proposer) of recorded continuations, keyed by prompt."""

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], alpha: float, vocab_size: int,
                 seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha is a probability, not {alpha}")
        self._records = [(list(prompt), list(prompt) + list(output)) for prompt, output in continuations.items()]
        self.alpha, self.vocab_size = alpha, vocab_size
        self._rng = random.Random(seed)
        self.num_proposed = 0  # draft tokens handed out
        self.num_true = 0  # of them, the recorded token
        self.num_diverged = 0  # proposals refused because the sequence had left its record

    def _record(self, token_ids: list[int]) -> list[int] | None:
        """prompt + recorded output of the sequence's prompt, or None when its tokens left the record."""
        mine = [full for prompt, full in self._records if token_ids[:len(prompt)] == prompt]
        if not mine:
            raise KeyError(f"no record for a sequence of {len(token_ids)} tokens")
        return next((full for full in mine if token_ids == full[:len(token_ids)]), None)

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            token_ids = list(r.token_ids)
            full = self._record(token_ids)
            if full is None:
                self.num_diverged += 1
                out.append([])
                continue
            truth = full[len(token_ids):len(token_ids) + r.k]
            is_true = [self._rng.random() < self.alpha for _ in truth]
            out.append([t if ok else (t + 1) % self.vocab_size for t, ok in zip(truth, is_true)])
            self.num_proposed += len(truth)
            self.num_true += sum(is_true)
        return out

    def forget(self, request_id: str, index: int = 0) -> None:
        """Nothing is kept per sequence."""
