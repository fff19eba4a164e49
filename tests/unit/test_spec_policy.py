"""Speculative decoding's pure cores around the engine: drafts in the batch policy (budget, pages reserved, then
rolled back by commit_drafts, with exact page ids) and adaptive k (spec/adaptive.py)."""
from __future__ import annotations

import pytest

from services.gpu_worker.spec.adaptive import AdaptiveK, DraftBudget
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


@pytest.mark.parametrize(("k", "proposed", "accepted", "want"), [
    (4, 4, 0, 2), (2, 2, 0, 1), (4, 4, 4, 4), (2, 2, 2, 4), (4, 4, 1, 2), (4, 3, 2, 3), (4, 0, 0, 4)])
def test_adaptive_k_follows_acceptance(k: int, proposed: int, accepted: int, want: int) -> None:
    budget = DraftBudget(k)
    AdaptiveK(max_k=4).update(budget, proposed, accepted)
    assert budget.k == want


def test_a_backed_off_sequence_probes_again_after_the_interval() -> None:
    adaptive = AdaptiveK(max_k=4, probe_interval_steps=3)
    budget = DraftBudget(1)
    adaptive.update(budget, 1, 0)
    assert budget.k == 0 and adaptive.is_waiting(budget)
    assert [adaptive.next_k(budget) for _ in range(3)] == [0, 0, 1]
    adaptive.update(budget, 1, 1)
    assert budget.k == 2


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


def test_empty_proposals_in_a_row_back_off_and_keep_k_for_the_probe() -> None:
    adaptive = AdaptiveK(max_k=4, probe_interval_steps=3, max_empty_proposals=2)
    budget = adaptive.new_budget()
    adaptive.on_proposed(budget, 0)
    adaptive.on_proposed(budget, 3)  # a proposal that found drafts ends the run of empty ones
    adaptive.on_proposed(budget, 0)
    assert not adaptive.is_waiting(budget)
    adaptive.on_proposed(budget, 0)
    assert adaptive.is_waiting(budget) and budget.k == 4
    assert [adaptive.next_k(budget) for _ in range(3)] == [0, 0, 4]
    adaptive.on_proposed(budget, 0)  # an empty probe waits again at once, twice as long
    assert [adaptive.next_k(budget) for _ in range(6)] == [0] * 5 + [4]
    adaptive.on_proposed(budget, 2)
    adaptive.update(budget, 2, 1)  # an accepted draft: the next wait starts from the interval again
    adaptive.on_proposed(budget, 0)
    adaptive.on_proposed(budget, 0)
    assert budget.num_wait_steps == 3


def test_failed_probes_double_the_wait_up_to_the_limit() -> None:
    adaptive = AdaptiveK(max_k=4, probe_interval_steps=2, max_wait_steps=6)
    budget = DraftBudget(1)
    waits = []
    for _ in range(4):
        adaptive.update(budget, 1, 0)
        waits.append(budget.num_wait_steps)
        while adaptive.next_k(budget) == 0:
            pass
    assert waits == [2, 4, 6, 6] and budget.k == 1
    adaptive.update(budget, 1, 1)
    assert (budget.k, budget.last_wait_steps) == (2, 0)
    adaptive.update(budget, 2, 0)
    adaptive.update(budget, 1, 0)
    assert budget.num_wait_steps == 2
