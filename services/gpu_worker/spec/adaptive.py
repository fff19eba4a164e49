"""Adaptive k: how many draft tokens to ask for, per sequence, from how its last proposals and verifications went.

Pure core. A draft the target rejects costs a forward position for nothing, so a sequence whose drafts keep failing
asks for fewer: k halves after a step that accepted none, down to 0 (plain decoding). A step that accepted every
draft doubles k (up to max_k); one that accepted some sets k to one more than it accepted.

A proposal that found nothing (no n-gram match) says nothing about acceptance and leaves k as it is, but it still
costs the step its overlap (the engine reads the launched step's tokens before proposing); so after
max_empty_proposals of them in a row the sequence backs off too, keeping its k for the probe.

A backed-off sequence waits, then probes once (with k, or 1 where k fell to 0). Each back-off in a row without an
accepted draft doubles the wait, from probe_interval_steps up to max_wait_steps: a sequence whose drafts never land
costs a probe ever more rarely, so it decodes nearly as a plain engine does.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROBE_INTERVAL_STEPS = 16
DEFAULT_MAX_WAIT_STEPS = 64
DEFAULT_MAX_EMPTY_PROPOSALS = 4


@dataclass
class DraftBudget:
    """One sequence's draft length: k now; while waiting, the steps left before a probe."""

    k: int
    num_wait_steps: int = 0
    last_wait_steps: int = 0  # the last wait's length, 0 once a draft is accepted: the next wait doubles it
    num_empty_proposals: int = 0  # in a row


class AdaptiveK:
    def __init__(self, max_k: int, probe_interval_steps: int = DEFAULT_PROBE_INTERVAL_STEPS,
                 max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS,
                 max_empty_proposals: int = DEFAULT_MAX_EMPTY_PROPOSALS) -> None:
        if max_k < 1 or probe_interval_steps < 1 or max_empty_proposals < 1:
            raise ValueError("need max_k, probe_interval_steps and max_empty_proposals >= 1, got "
                             f"{max_k}, {probe_interval_steps}, {max_empty_proposals}")
        self.max_k, self.max_empty_proposals = max_k, max_empty_proposals
        self.probe_interval_steps, self.max_wait_steps = probe_interval_steps, max(max_wait_steps, probe_interval_steps)

    def new_budget(self) -> DraftBudget:
        return DraftBudget(self.max_k)

    def next_k(self, budget: DraftBudget) -> int:
        """The drafts to ask for this step (a step of a waiting sequence counts down to its probe)."""
        if budget.num_wait_steps > 0:
            budget.num_wait_steps -= 1
            if budget.num_wait_steps > 0:
                return 0
            budget.k = max(budget.k, 1)
        return budget.k

    def is_waiting(self, budget: DraftBudget) -> bool:
        """Backed off, and not probing at the next step either."""
        return budget.num_wait_steps > 1

    def on_proposed(self, budget: DraftBudget, num_drafts: int) -> None:
        """The proposer was asked for drafts and gave num_drafts."""
        if num_drafts:
            budget.num_empty_proposals = 0
            return
        budget.num_empty_proposals += 1  # NOTE: not reset by backing off: an empty probe backs off again at once
        if budget.num_empty_proposals >= self.max_empty_proposals:
            self._back_off(budget)

    def update(self, budget: DraftBudget, num_proposed: int, num_accepted: int) -> None:
        """A verification of num_proposed drafts accepted num_accepted of them."""
        if num_proposed == 0:
            return
        if num_accepted == 0:
            budget.k //= 2
            if budget.k == 0:
                self._back_off(budget)
            return
        budget.last_wait_steps = 0
        if num_accepted == num_proposed:
            budget.k = min(self.max_k, max(2 * budget.k, num_accepted + 1))
        else:
            budget.k = min(self.max_k, num_accepted + 1)

    def _back_off(self, budget: DraftBudget) -> None:
        wait = self.probe_interval_steps if not budget.last_wait_steps else 2 * budget.last_wait_steps
        budget.num_wait_steps = budget.last_wait_steps = min(wait, self.max_wait_steps)
