"""Adaptive k: how many draft tokens to ask for, per sequence, from how many its last verifications accepted.

Pure core. A draft the target rejects costs a forward position for nothing, so a sequence whose drafts keep failing
asks for fewer: k halves after a step that accepted none, down to 0 (plain decoding). At 0 it waits
probe_interval_steps steps and then probes with k = 1. A step that accepted every draft doubles k (up to max_k); one
that accepted some sets k to one more than it accepted. A step that proposed nothing (no n-gram match) says nothing
about acceptance and leaves k as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROBE_INTERVAL_STEPS = 16


@dataclass
class DraftBudget:
    """One sequence's draft length: k now, and while k is 0 the steps left before a probe."""

    k: int
    num_wait_steps: int = 0


class AdaptiveK:
    def __init__(self, max_k: int, probe_interval_steps: int = DEFAULT_PROBE_INTERVAL_STEPS) -> None:
        if max_k < 1 or probe_interval_steps < 1:
            raise ValueError(f"need max_k >= 1 and probe_interval_steps >= 1, got {max_k}, {probe_interval_steps}")
        self.max_k, self.probe_interval_steps = max_k, probe_interval_steps

    def new_budget(self) -> DraftBudget:
        return DraftBudget(self.max_k)

    def next_k(self, budget: DraftBudget) -> int:
        """The drafts to ask for this step (a step of a backed-off sequence counts down to its probe)."""
        if budget.k == 0:
            budget.num_wait_steps -= 1
            if budget.num_wait_steps <= 0:
                budget.k = 1
        return budget.k

    def is_waiting(self, budget: DraftBudget) -> bool:
        """Backed off, and not probing at the next step either."""
        return budget.k == 0 and budget.num_wait_steps > 1

    def update(self, budget: DraftBudget, num_proposed: int, num_accepted: int) -> None:
        """A verification of num_proposed drafts accepted num_accepted of them."""
        if num_proposed == 0:
            return
        if num_accepted == 0:
            budget.k //= 2
            if budget.k == 0:
                budget.num_wait_steps = self.probe_interval_steps
        elif num_accepted == num_proposed:
            budget.k = min(self.max_k, max(2 * budget.k, num_accepted + 1))
        else:
            budget.k = min(self.max_k, num_accepted + 1)
