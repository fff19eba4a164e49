"""Adaptive drafting: which sequences draft in a step, and how many tokens each asks for, from what drafts have
earned and what they cost.

Pure core. Two estimates and two costs:
- Acceptance, per sequence: the chance that its first draft is accepted (p1), and that a draft after an accepted one
  is (pc). Each is a decayed count over the sequence's verifications (the recent ones weigh most), started from an
  even prior. The two are kept apart because prompt-lookup drafts come in runs: a copied passage goes on or it does
  not, so pc is often well above p1.
- Cost, per engine (DraftCosts): a step that verifies drafts costs `step` more than a plain step, in plain steps (on
  CUDA the host work that a drafting step cannot overlap), and each draft token costs `token` more, in tokens of the
  step's throughput (small where a step is bound by reading the weights, large where it is bound by compute). On
  CUDA a step also grows with its tokens past `ridge_tokens`, where reading the weights stops bounding it, and the
  verify graph pads every decode to k + 1 rows: at 64 decodes and k = 4 a drafting step runs 320 rows, well past
  the ridge, and costs about 1.6 plain steps whatever the drafts (step_cost).

A sequence asks for the k that maximises its expected accepted drafts, p1 · (1 + pc + ... + pc^(k-1)), less k · token:
draft j is worth p1 · pc^(j-1). A step drafts only where its sequences' expected gains together exceed its cost
(step_cost) times the decodes in it; otherwise every decode of the step would pay the step's cost for the few that
gain. A sequence that expects no gain, that a step's shortfall stops, or whose proposals found nothing
max_empty_proposals times in a row, backs off: it waits, then probes once. Each back-off in a row without an
accepted draft doubles the wait, from probe_interval_steps up to max_wait_steps, so a sequence whose drafts never land
costs a probe ever more rarely. A probe that falls due counts what a new sequence expects (the priors) towards its
step's sum: alone at batch 1 it drafts at once, but one probe does not turn a step of 64 decodes into a verify step;
it stays due and drafts with the next step that drafts, or once enough probes are due together to pay for one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PROBE_INTERVAL_STEPS = 16
DEFAULT_MAX_WAIT_STEPS = 64
DEFAULT_MAX_EMPTY_PROPOSALS = 4
DECAY = 0.9  # each verification's weight against the one after it (about ten verifications carry the estimate)
# (accepted, tried) before any verification: first drafts even, later ones hopeful, so that a new sequence drafts
# several tokens and measures how far its runs go (with one draft a step, `later` would never be observed)
PRIOR_FIRST = (1.0, 2.0)
PRIOR_LATER = (3.0, 4.0)
# rows a bf16 step of an H100/H200 runs before compute, not the weights' read, bounds it (DraftCosts)
CUDA_RIDGE_TOKENS = 192.0


@dataclass(frozen=True)
class DraftCosts:
    """What drafting costs beside a plain step (module docstring).

    Measured:
    - CUDA, overlap mode (Llama-3.1-8B shapes, H100, bench.spec_decode --proposer replay, 2026-12-06): a step that
      verified 3-4 drafts a sequence took 1.25x (batch 1) and 1.29x (batch 8) a plain step, and the same time with 2.9
      drafts a sequence as with 3.7 (the verify graph is padded to k), so step 0.3, token 0.02; serial, a step has
      no overlap to lose: step 0.05. With this gate (H100, 2026-12-07, α = 0: drafts of 4 that all failed), a
      drafted step cost 0.20 of a plain step more at batch 1, 0.43 at batch 8 and 0.57 at batch 64 (320 rows).
    - The ridge: a bf16 step reads all the weights once and does 2 FLOP a weight a row, so it turns compute-bound at
      about FLOP rate ÷ bandwidth rows: H100 790 TFLOP/s ÷ 3.35 TB/s ≈ 236 (which predicts batch 64's 0.57 above
      with an overhead of 0.2), H200 ÷ 4.8 TB/s ≈ 165. 192 sits between.
    - CPU (the bundled 135M model, bench.spec_decode --device cpu, 2026-12-05): a step verifying about four drafts
      cost about 2.3x a plain step, and the CPU runs a step's work as it is launched: step 0.05, token 0.3 (the
      token cost already holds the compute: no ridge).
    """

    step: float
    token: float
    ridge_tokens: float | None = None

    @classmethod
    def for_engine(cls, device_type: str, overlapped: bool) -> DraftCosts:
        if device_type == "cuda":
            return cls(0.3 if overlapped else 0.05, 0.02, CUDA_RIDGE_TOKENS)
        return cls(0.05, 0.3)  # on the CPU a step's work runs as it is launched: overlap hides little

    def step_cost(self, num_decoding: int, max_k: int) -> float:
        """What a step of num_decoding decodes costs more when it verifies drafts of up to max_k tokens, in plain
        steps: `step`, plus the rows past the ridge (every decode padded to max_k + 1 rows)."""
        if self.ridge_tokens is None or num_decoding < 1:
            return self.step
        plain = max(1.0, num_decoding / self.ridge_tokens)
        verify = max(1.0, num_decoding * (max_k + 1) / self.ridge_tokens)
        return self.step + (verify - plain) / plain


@dataclass
class DraftBudget:
    """One sequence's acceptance estimates and back-off state."""

    first: list[float] = field(default_factory=lambda: list(PRIOR_FIRST))  # [accepted, tried] of first drafts
    later: list[float] = field(default_factory=lambda: list(PRIOR_LATER))  # [accepted, tried] of drafts after an accepted one
    num_wait_steps: int = 0  # steps left before its probe is due
    last_wait_steps: int = 0  # the last wait's length, 0 once a draft is accepted: the next wait doubles it
    num_empty_proposals: int = 0  # in a row
    is_backed_off: bool = False  # waiting for its probe

    def rates(self) -> tuple[float, float]:
        return self.first[0] / self.first[1], self.later[0] / self.later[1]


class AdaptiveK:
    def __init__(self, max_k: int, costs: DraftCosts = DraftCosts(0.3, 0.02),
                 probe_interval_steps: int = DEFAULT_PROBE_INTERVAL_STEPS, max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS,
                 max_empty_proposals: int = DEFAULT_MAX_EMPTY_PROPOSALS) -> None:
        if max_k < 1 or probe_interval_steps < 1 or max_empty_proposals < 1:
            raise ValueError("need max_k, probe_interval_steps and max_empty_proposals >= 1, got "
                             f"{max_k}, {probe_interval_steps}, {max_empty_proposals}")
        self.max_k, self.costs, self.max_empty_proposals = max_k, costs, max_empty_proposals
        self.probe_interval_steps, self.max_wait_steps = probe_interval_steps, max(max_wait_steps, probe_interval_steps)
        self._probe_gain = self.best(DraftBudget())[1]  # what a probe may find: a new sequence's expected gain

    def new_budget(self) -> DraftBudget:
        return DraftBudget()

    def best(self, budget: DraftBudget) -> tuple[int, float]:
        """(k, gain): the draft count with the most expected accepted drafts less its token cost (at least 1), and
        that net gain in tokens."""
        p1, pc = budget.rates()
        k, gain, worth, total = 1, p1 - self.costs.token, p1, p1
        for j in range(2, self.max_k + 1):
            worth *= pc
            total += worth
            if total - j * self.costs.token > gain:
                k, gain = j, total - j * self.costs.token
        return k, gain

    def plan(self, budgets: list[DraftBudget], num_decoding: int) -> list[int]:
        """This step's draft count for each of these sequences (0: none), given num_decoding decodes in the step.
        Call once a step: it counts the steps of the backed-off sequences' waits."""
        ks = [0] * len(budgets)
        hopeful: list[tuple[int, int, float]] = []  # (index, k, gain) of the sequences not backed off
        due: list[int] = []  # backed-off sequences whose wait is over: probes
        for i, budget in enumerate(budgets):
            if budget.is_backed_off:
                budget.num_wait_steps = max(0, budget.num_wait_steps - 1)
                if budget.num_wait_steps == 0:
                    due.append(i)
                continue
            k, gain = self.best(budget)
            if gain <= 0:
                self._back_off(budget, now=True)
            else:
                hopeful.append((i, k, gain))
        if not hopeful and not due:
            return ks
        gains = sum(gain for _, _, gain in hopeful) + len(due) * self._probe_gain
        if gains <= self.costs.step_cost(num_decoding, self.max_k) * num_decoding:
            for i, _, _ in hopeful:
                self._back_off(budgets[i], now=True)
            return ks  # the due probes stay due
        for i, k, _ in hopeful:
            ks[i] = k
        for i in due:
            budgets[i].is_backed_off = False
            ks[i] = self.best(budgets[i])[0]
        return ks

    def is_waiting(self, budget: DraftBudget) -> bool:
        return budget.is_backed_off

    def on_proposed(self, budget: DraftBudget, num_drafts: int) -> None:
        """The proposer was asked for drafts and gave num_drafts."""
        if num_drafts:
            budget.num_empty_proposals = 0
            return
        budget.num_empty_proposals += 1  # NOTE: not reset by backing off: an empty probe backs off again at once
        if budget.num_empty_proposals >= self.max_empty_proposals:
            self._back_off(budget)

    def update(self, budget: DraftBudget, num_proposed: int, num_accepted: int) -> None:
        """A verification of num_proposed drafts accepted the first num_accepted of them."""
        if num_proposed == 0:
            return
        _observe(budget.first, 1.0 if num_accepted else 0.0, 1.0)
        later_tried = min(num_accepted + 1, num_proposed) - 1  # drafts 2.. that followed an accepted one
        if later_tried > 0:
            _observe(budget.later, float(max(0, num_accepted - 1)), float(later_tried))
        if num_accepted:
            budget.last_wait_steps = 0

    def _back_off(self, budget: DraftBudget, now: bool = False) -> None:
        """Wait before probing again; now: the wait's first step is the step being planned."""
        wait = self.probe_interval_steps if not budget.last_wait_steps else 2 * budget.last_wait_steps
        budget.num_wait_steps = budget.last_wait_steps = min(wait, self.max_wait_steps)
        budget.num_wait_steps -= now
        budget.is_backed_off = True


def _observe(counts: list[float], accepted: float, tried: float) -> None:
    counts[0] = DECAY * counts[0] + accepted
    counts[1] = DECAY * counts[1] + tried
