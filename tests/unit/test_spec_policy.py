"""Speculative decoding's pure cores around the engine: drafts in the batch policy (budget, pages reserved, then
rolled back by commit_drafts, with exact page ids) and adaptive drafting (spec/adaptive.py)."""
from __future__ import annotations

import pytest

from services.gpu_worker.spec.adaptive import CUDA_RIDGE_TOKENS, AdaptiveK, DraftBudget, DraftCosts
from tests.unit.test_batch_policy import end_step, new_seq, small_policy, step


def _decoding(policy, seq_id: int, num_prompt_tokens: int):
    seq = new_seq(seq_id, num_prompt_tokens)
    policy.add(seq)
    step(policy, 0.0)  # prefilled, first token appended: it decodes from now on
    return seq


def test_drafts_reserve_pages_and_rejected_ones_are_rolled_back() -> None:
    policy = small_policy(num_pages=8, max_num_batched_tokens=64)
    seq = _decoding(policy, 0, 7)  # 8 tokens, 7 computed: pages [1, 2]
    assert (seq.page_ids, seq.num_computed) == ([1, 2], 7)
    seq.draft_token_ids = [5, 6, 7, 8, 9]
    plan = policy.schedule(0.0)
    item = plan.items[0]
    assert (item.num_new_tokens, item.num_draft_tokens, item.is_sampling) == (6, 5, True)
    assert seq.page_ids == [1, 2, 3, 4]  # positions 7..12
    assert policy.advance(plan) == [seq] and seq.num_computed == 8  # the last token only, not the drafts
    policy.cache_computed(seq, 0.0)
    seq.token_ids += [5, 6, 11]  # two drafts accepted, then the target's own token
    policy.commit_drafts(seq, 2, 0.0)
    assert (seq.num_computed, seq.page_ids) == (10, [1, 2, 3])
    assert policy.pool.num_free == 8 - 3  # page 4 is back
    assert policy.cache.match_prefix(seq.token_ids, 0.0).num_tokens == 8  # only the full, verified pages
    policy.check_invariants()
    policy.pool.check_invariants()


def test_drafts_take_only_the_budget_every_decode_leaves() -> None:
    policy = small_policy(num_pages=16, max_num_batched_tokens=6)
    seqs = [_decoding(policy, i, 3) for i in range(3)]
    for seq in seqs:
        seq.draft_token_ids = [1, 2, 3, 4]
    plan = policy.schedule(0.0)
    assert [(item.num_new_tokens, item.num_draft_tokens) for item in plan.items] == [(4, 3), (1, 0), (1, 0)]
    assert seqs[0].draft_token_ids == [1, 2, 3] and seqs[1].draft_token_ids == []
    end_step(policy, plan, 0.0)


def test_drafts_that_find_no_pages_are_dropped_rather_than_preempting() -> None:
    policy = small_policy(num_pages=3, max_num_batched_tokens=64)
    first, second = new_seq(0, 7), new_seq(1, 3)
    policy.add(first)
    policy.add(second)
    step(policy, 0.0)  # first: pages [1, 2], its next token's slot (position 7) in page 2; second: [3]; pool full
    assert (first.page_ids, second.page_ids, policy.pool.num_free) == ([1, 2], [3], 0)
    first.draft_token_ids = [5, 6, 7, 8, 9]  # positions 8..12 would need two more pages
    plan = policy.schedule(0.0)
    assert [(item.seq.seq_id, item.num_new_tokens, item.num_draft_tokens) for item in plan.items] == [(0, 1, 0),
                                                                                                      (1, 1, 0)]
    assert policy.num_preemptions == 0 and first.draft_token_ids == []
    end_step(policy, plan, 0.0)


GPU = DraftCosts(step=0.3, token=0.02)
CPU = DraftCosts(step=0.05, token=0.3)


def _verify_many(adaptive: AdaptiveK, budget: DraftBudget, k: int, accepted: list[int]) -> None:
    for a in accepted:
        adaptive.update(budget, k, a)


def _probe_steps(adaptive: AdaptiveK, budget: DraftBudget, steps: int) -> list[int]:
    """The steps (counted from 1) at which a lone sequence drafts, over this many steps, every draft rejected."""
    drafted = []
    for step in range(1, steps + 1):
        k = adaptive.plan([budget], 1)[0]
        if k:
            drafted.append(step)
            adaptive.on_proposed(budget, k)
            adaptive.update(budget, k, 0)
    return drafted


def test_where_a_draft_token_is_nearly_free_k_stays_at_its_maximum_at_half_acceptance() -> None:
    """The old rule (k = accepted + 1, halved on a miss) drafted 1.7 tokens a verification at acceptance 0.5 and
    gained nothing over plain decoding on the H100 (TPOT 0.986x); at 0.5 four drafts are still worth their cost."""
    adaptive = AdaptiveK(max_k=4, costs=GPU)
    budget = adaptive.new_budget()
    _verify_many(adaptive, budget, 4, [0, 1, 0, 2, 1, 0, 1, 0, 3, 0])
    assert adaptive.best(budget)[0] == 4
    assert adaptive.plan([budget], 1) == [4]


def test_where_each_draft_costs_compute_k_follows_the_runs_of_acceptance() -> None:
    adaptive = AdaptiveK(max_k=8, costs=CPU)
    copying, guessing = adaptive.new_budget(), adaptive.new_budget()
    _verify_many(adaptive, copying, 8, [8, 6, 8, 0, 8, 7, 8, 8])  # a copied passage: long runs
    _verify_many(adaptive, guessing, 4, [1, 0, 0, 1, 0, 0, 0, 0])  # rarely a first draft, never a second
    assert adaptive.best(copying)[0] >= 6
    assert adaptive.best(guessing)[0] == 1
    assert adaptive.plan([copying, guessing], 2) == [adaptive.best(copying)[0], 0]  # no gain: backs off
    assert adaptive.is_waiting(guessing) and not adaptive.is_waiting(copying)


def test_a_step_drafts_only_where_the_gains_cover_its_cost() -> None:
    """Eight decodes, one with fair drafts: drafting would make all eight pay the step's cost for one's gain."""
    adaptive = AdaptiveK(max_k=4, costs=GPU)
    fair, *rest = [adaptive.new_budget() for _ in range(8)]
    _verify_many(adaptive, fair, 4, [1, 2, 1, 1, 2, 1])
    for budget in rest:
        _verify_many(adaptive, budget, 4, [0] * 10)
    gain = adaptive.best(fair)[1]
    assert GPU.step < gain < GPU.step * 8
    assert adaptive.plan([fair, *rest], 8) == [0] * 8
    assert all(adaptive.is_waiting(b) for b in (fair, *rest))
    alone = adaptive.new_budget()
    _verify_many(adaptive, alone, 4, [1, 2, 1, 1, 2, 1])
    assert adaptive.plan([alone], 1) == [adaptive.best(alone)[0]] != [0]  # alone it pays for its own step
    good = [adaptive.new_budget() for _ in range(8)]
    for budget in good:
        _verify_many(adaptive, budget, 4, [4, 3, 4, 4])
    assert adaptive.plan(good, 8) == [4] * 8


def test_rejected_drafts_back_off_and_waits_double_up_to_the_limit() -> None:
    adaptive = AdaptiveK(max_k=4, costs=GPU, probe_interval_steps=4, max_wait_steps=16)
    budget = adaptive.new_budget()
    steps = _probe_steps(adaptive, budget, 80)
    first = [s for s in steps if s <= 4]
    probes = steps[len(first):]
    assert first and len(first) <= 4  # the even prior drafts until the misses outweigh it
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:2] == [8, 16] and set(gaps[2:]) == {16}
    adaptive.update(budget, 4, 2)  # an accepted draft: the next wait starts from the interval again
    assert budget.last_wait_steps == 0


def test_empty_proposals_in_a_row_back_off() -> None:
    adaptive = AdaptiveK(max_k=4, probe_interval_steps=3, max_empty_proposals=2)
    budget = adaptive.new_budget()
    adaptive.on_proposed(budget, 0)
    adaptive.on_proposed(budget, 3)  # a proposal that found drafts ends the run of empty ones
    adaptive.on_proposed(budget, 0)
    assert not adaptive.is_waiting(budget)
    adaptive.on_proposed(budget, 0)
    assert adaptive.is_waiting(budget) and budget.num_wait_steps == 3
    adaptive.on_proposed(budget, 0)  # an empty probe waits again at once, twice as long
    assert budget.num_wait_steps == 6


def test_costs_by_engine() -> None:
    assert DraftCosts.for_engine("cuda", overlapped=True) == DraftCosts(0.3, 0.02, CUDA_RIDGE_TOKENS)
    assert DraftCosts.for_engine("cuda", overlapped=False) == DraftCosts(0.05, 0.02, CUDA_RIDGE_TOKENS)
    assert DraftCosts.for_engine("cpu", overlapped=True) == DraftCosts.for_engine("cpu", overlapped=False) == CPU


CUDA = DraftCosts.for_engine("cuda", overlapped=True)


def test_a_step_past_the_ridge_costs_its_rows() -> None:
    """On the H100 a drafting step of 64 decodes (320 rows at k = 4) cost 0.57 plain steps more, of 1 decode 0.20 and
    of 8 decodes 0.43: below the ridge only the fixed cost counts, past it the padded rows do."""
    assert CUDA.step_cost(1, 4) == CUDA.step_cost(8, 4) == CUDA.step
    assert CUDA.step_cost(64, 4) == pytest.approx(CUDA.step + 64 * 5 / CUDA_RIDGE_TOKENS - 1)
    assert CUDA.step_cost(512, 4) == pytest.approx(CUDA.step + 4)  # compute-bound both ways: 5x the rows
    assert CPU.step_cost(64, 4) == CPU.step


def _drafted_steps(adaptive: AdaptiveK, budgets: list[DraftBudget], steps: int, accepted: float) -> int:
    """Steps in which some of these decodes draft, each draft token accepted at this rate (0 or 1 here)."""
    drafted = 0
    for _ in range(steps):
        ks = adaptive.plan(budgets, len(budgets))
        drafted += any(ks)
        for budget, k in zip(budgets, ks):
            if k:
                adaptive.update(budget, k, int(k * accepted))
    return drafted


def test_at_batch_64_drafts_that_never_land_cost_few_steps() -> None:
    """α = 0 at batch 64 on the H100 drafted in 12 of 96 steps (all 64 sequences together) and cost 7.1 %: each
    such step runs 320 rows. Priced by its rows, the step stops drafting after one miss."""
    adaptive = AdaptiveK(max_k=4, costs=CUDA)
    assert _drafted_steps(adaptive, [adaptive.new_budget() for _ in range(64)], 96, 0.0) <= 3
    alone = AdaptiveK(max_k=4, costs=CUDA)  # at batch 1 the step is cheap: the priors take a few misses to unlearn
    assert 3 <= _drafted_steps(alone, [alone.new_budget()], 96, 0.0) <= 9


def test_at_batch_64_only_drafts_that_pay_for_the_rows_are_made() -> None:
    adaptive = AdaptiveK(max_k=4, costs=CUDA)
    good = [adaptive.new_budget() for _ in range(64)]
    for budget in good:
        _verify_many(adaptive, budget, 4, [4, 3, 2, 4, 3, 4])  # about 0.8
    assert adaptive.plan(good, 64) == [4] * 64
    half = [adaptive.new_budget() for _ in range(64)]
    for budget in half:
        _verify_many(adaptive, budget, 4, [1, 0, 2, 0, 1, 1, 0, 1])  # about 0.5: lost at batch 64 (H100: 1.7x TPOT)
    assert adaptive.plan(half, 64) == [0] * 64
    lone = adaptive.new_budget()
    _verify_many(adaptive, lone, 4, [1, 0, 2, 0, 1, 1, 0, 1])
    assert adaptive.plan([lone], 1) != [0]  # the same estimates pay at batch 1


def test_one_due_probe_does_not_make_a_big_step_verify() -> None:
    """Served sequences fall due for their probes at different steps; if each probe made its step a verify step, a
    batch of 64 would pay 1.6 steps nearly every step for one sequence's probe. A due probe waits for a step that
    drafts anyway, or for enough probes due together to pay for one."""
    adaptive = AdaptiveK(max_k=4, costs=CUDA, probe_interval_steps=4)
    budgets = [adaptive.new_budget() for _ in range(64)]
    for budget in budgets:
        _verify_many(adaptive, budget, 4, [0] * 6)
    for i, budget in enumerate(budgets):  # backed off, probes due at different steps: the first now
        adaptive._back_off(budget)
        budget.num_wait_steps = 1 + i
    assert adaptive.plan(budgets, 64) == [0] * 64
    assert adaptive.is_waiting(budgets[0]) and budgets[0].num_wait_steps == 0  # still due
    for _ in range(63):
        ks = adaptive.plan(budgets, 64)
        if any(ks):
            break
    assert any(ks) and sum(k > 0 for k in ks) * adaptive.best(DraftBudget())[1] > CUDA.step_cost(64, 4) * 64  # they pay together
    lone = adaptive.new_budget()
    _verify_many(adaptive, lone, 4, [0] * 6)
    adaptive._back_off(lone)
    lone.num_wait_steps = 1
    assert adaptive.plan([lone], 1) != [0]  # alone, a probe drafts when it falls due
