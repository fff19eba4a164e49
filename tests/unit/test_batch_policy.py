"""BatchPolicy, driven as the engine drives it (schedule, then advance + cache_computed): the token budget split
between decodes and prefill chunks, admission limits, preemption, and eviction from a full prefix cache."""
from __future__ import annotations

from services.gpu_worker.batch_policy import EVICT_BATCH_FRACTION, RUNNING_PER_ADMITTED, BatchPolicy, StepPlan
from services.gpu_worker.block_pool import BlockPool
from services.gpu_worker.radix_cache import RadixCache
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.sequence import Sequence, SeqStatus

PAGE_SIZE = 4
NUM_PAGES = 1 + 1024


def small_policy(num_pages: int, max_num_batched_tokens: int = 64, max_num_seqs: int = 8) -> BatchPolicy:
    """A policy over 1 + num_pages pages (page 0 is reserved), too small for eviction batches."""
    pool = BlockPool(1 + num_pages)
    return BatchPolicy(pool, RadixCache(pool, PAGE_SIZE, "salt"), PAGE_SIZE, max_num_batched_tokens, max_num_seqs)


def new_seq(seq_id: int, num_prompt_tokens: int) -> Sequence:
    """A sequence whose prompt shares no page with any other's."""
    prompt = [1000 * (seq_id + 1) + t for t in range(num_prompt_tokens)]
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, num_prompt_tokens, SamplingParams(max_tokens=64), 0.0)


def end_step(policy: BatchPolicy, plan: StepPlan, now: float) -> None:
    """What the engine does after a step: sampling items get a token, then advance and cache_computed."""
    for item in plan.items:
        if item.is_sampling:
            item.seq.token_ids.append(7)
    for seq in policy.advance(plan):
        policy.cache_computed(seq, now)
    policy.check_invariants()
    policy.pool.check_invariants()
    policy.cache.check_invariants()


def step(policy: BatchPolicy, now: float) -> StepPlan:
    plan = policy.schedule(now)
    end_step(policy, plan, now)
    return plan


def items_of(plan: StepPlan) -> list[tuple[int, int, bool]]:
    return [(item.seq.seq_id, item.num_new_tokens, item.is_sampling) for item in plan.items]


def test_chunked_prefill_spends_the_rest_of_the_budget_on_the_next_prompt() -> None:
    policy = small_policy(num_pages=8, max_num_batched_tokens=10)
    a, b = new_seq(0, 8), new_seq(1, 6)
    policy.add(a)
    policy.add(b)
    first = step(policy, now=1.0)
    assert items_of(first) == [(0, 8, True), (1, 2, False)]  # b's first chunk is what the budget leaves
    assert first.admitted == [a, b] and first.num_tokens == 10
    assert (a.page_ids, a.num_computed, b.page_ids, b.num_computed) == ([1, 2], 8, [3], 2)
    second = step(policy, now=2.0)
    assert items_of(second) == [(0, 1, True), (1, 4, True)]
    assert second.admitted == []
    assert (a.page_ids, b.page_ids) == ([1, 2, 4], [3, 5])  # pages taken on demand, in scheduling order


def test_decodes_take_the_budget_before_a_prefill_chunk() -> None:
    policy = small_policy(num_pages=16, max_num_batched_tokens=4)
    decodes = [new_seq(i, 1) for i in range(3)]
    prompt = new_seq(3, 12)
    for seq in decodes + [prompt]:
        policy.add(seq)
    assert items_of(step(policy, now=1.0)) == [(0, 1, True), (1, 1, True), (2, 1, True), (3, 1, False)]
    assert items_of(step(policy, now=2.0)) == [(0, 1, True), (1, 1, True), (2, 1, True), (3, 1, False)]
    waiting = new_seq(4, 1)
    policy.add(waiting)
    plan = step(policy, now=3.0)
    assert items_of(plan) == [(0, 1, True), (1, 1, True), (2, 1, True), (3, 1, False)]
    assert list(policy.waiting) == [waiting] and prompt.num_computed == 3
    policy.finish(decodes[0], now=4.0)
    # a long prompt chunk leaves half of what the decodes left to the waiting sequence
    assert items_of(step(policy, now=5.0)) == [(1, 1, True), (2, 1, True), (3, 1, False), (4, 1, True)]
    assert items_of(step(policy, now=6.0)) == [(1, 1, True), (2, 1, True), (4, 1, True), (3, 1, False)]


def test_a_short_prompt_behind_long_ones_starts_within_a_few_steps() -> None:
    """Issue 31, item 5: three long prompts take the whole budget of every step until all are computed; a short
    request that arrives behind them must not wait for that (it did: 3 × 60 tokens at 16 a step, 12 steps)."""
    policy = small_policy(num_pages=128, max_num_batched_tokens=16, max_num_seqs=8)
    longs = [new_seq(i, 60) for i in range(3)]
    short = new_seq(3, 3)
    for seq in longs + [short]:
        policy.add(seq)
    steps_until_short = None
    for n in range(1, 20):
        plan = step(policy, now=float(n))
        assert plan.num_tokens == 16 or not policy.waiting  # the budget is never left unused while work waits
        if any(item.seq is short and item.is_sampling for item in plan.items):
            steps_until_short = n
            break
    assert steps_until_short is not None and steps_until_short <= 4
    assert all(seq.num_computed < seq.num_prompt_tokens for seq in longs)  # they were still prefilling


def test_a_long_prompt_alone_still_takes_the_whole_budget() -> None:
    policy = small_policy(num_pages=64, max_num_batched_tokens=16)
    long = new_seq(0, 60)
    policy.add(long)
    assert items_of(step(policy, now=1.0)) == [(0, 16, False)]
    assert items_of(step(policy, now=2.0)) == [(0, 16, False)]
    late = new_seq(1, 30)  # long as well: admission gets its reserve, the running prompt the rest
    policy.add(late)
    assert items_of(step(policy, now=3.0)) == [(0, 12, False), (1, 4, False)]
    assert items_of(step(policy, now=4.0)) == [(0, 16, True)]  # nothing waits: the first long prompt goes first


def test_a_dry_pool_preempts_the_newest_running_sequence_and_evicts_its_pages() -> None:
    policy = small_policy(num_pages=6)
    a, b, c = new_seq(0, 4), new_seq(1, 4), new_seq(2, 4)
    for seq in (a, b, c):
        policy.add(seq)
    step(policy, now=1.0)
    assert (a.page_ids, b.page_ids, c.page_ids) == ([1], [2], [3])
    for now in (2.0, 3.0, 4.0, 5.0):  # the fifth token of each takes a second page; four decodes fill it
        assert step(policy, now).preempted == []
    assert (a.page_ids, b.page_ids, c.page_ids) == ([1, 4], [2, 5], [3, 6])
    assert policy.pool.num_free == 0 and a.num_computed == 8 and a.num_tokens == 9
    plan = step(policy, now=6.0)
    # a needs a third page: c (newest) is preempted and its cached tail page 6 evicted for a; b then takes
    # c's other page 3, now unlocked in the cache; c cannot come back (its prefix is gone, the pool is dry)
    assert plan.preempted == [c]
    assert items_of(plan) == [(0, 1, True), (1, 1, True)]
    assert (a.page_ids, b.page_ids, c.page_ids) == ([1, 4, 6], [2, 5, 3], [])
    assert (c.status, c.num_computed, c.num_preemptions, policy.num_preemptions) == (SeqStatus.WAITING, 0, 1, 1)
    assert list(policy.waiting) == [c] and policy.running == [a, b]
    assert policy.pool.num_free == 0 and policy.cache.num_evictable_pages == 0


def test_admission_stops_at_max_num_seqs_and_the_rest_keep_waiting() -> None:
    policy = small_policy(num_pages=16, max_num_seqs=2)
    seqs = [new_seq(i, 3) for i in range(4)]
    for seq in seqs:
        policy.add(seq)
    first = step(policy, now=1.0)
    assert items_of(first) == [(0, 3, True), (1, 3, True)]
    assert first.admitted == seqs[:2] and policy.running == seqs[:2]
    assert list(policy.waiting) == seqs[2:] and all(s.page_ids == [] for s in seqs[2:])
    assert items_of(step(policy, now=2.0)) == [(0, 1, True), (1, 1, True)]
    assert list(policy.waiting) == seqs[2:]
    policy.finish(seqs[0], now=3.0)
    plan = step(policy, now=4.0)
    assert items_of(plan) == [(1, 1, True), (2, 3, True)]
    assert plan.admitted == [seqs[2]] and list(policy.waiting) == [seqs[3]]


def full_policy() -> BatchPolicy:
    """Every page but four is held by the cache alone (evictable), in 255 one-page leaves of distinct requests
    plus a chain of 765 one-page nodes, as finished decodes leave it."""
    pool = BlockPool(NUM_PAGES)
    cache = RadixCache(pool, PAGE_SIZE, "salt")
    for i in range(255):
        pages = pool.allocate(1)
        cache.insert([10_000 + i] * PAGE_SIZE, pages, now=float(i))
        pool.free(pages)
    chain = [20_000 + t for t in range(765 * PAGE_SIZE)]
    pages = pool.allocate(765)
    for num_pages in range(1, 766):
        cache.insert(chain[:num_pages * PAGE_SIZE], pages[:num_pages], now=1000.0 + num_pages)
    pool.free(pages)
    assert pool.num_free == 4
    return BatchPolicy(pool, cache, PAGE_SIZE, max_num_batched_tokens=64, max_num_seqs=8)


def test_a_dry_pool_evicts_a_batch_beyond_the_shortfall() -> None:
    policy = full_policy()
    assert policy.num_evict_batch_pages == int(1024 * EVICT_BATCH_FRACTION) == 4
    seq = Sequence(0, "r0", 0, list(range(1, 4 * PAGE_SIZE + 1)), 4 * PAGE_SIZE, SamplingParams(max_tokens=8), 0.0)
    policy.add(seq)
    plan = policy.schedule(now=5000.0)
    assert [item.num_new_tokens for item in plan.items] == [4 * PAGE_SIZE]
    assert len(seq.page_ids) == 4 and policy.pool.num_free == 0  # the four free pages sufficed: no eviction
    seq.token_ids.append(7)
    end_step(policy, plan, now=5001.0)
    policy.schedule(now=5002.0)  # the decode needs a fifth page: one short, so 1 + 4 are evicted
    assert seq.page_ids == [1021, 1022, 1023, 1024, 5]  # the five least recently used leaves went, oldest first
    assert [policy.pool.ref_count(p) for p in range(1, 7)] == [0, 0, 0, 0, 1, 1]
    assert policy.pool.num_free == 4
    assert policy.cache.num_cached_pages == 1020 + 4 - 5
    policy.pool.check_invariants()
    policy.cache.check_invariants()


def test_admission_in_batches_waits_for_enough_seats_or_the_delay() -> None:
    """min_admit_batch: a step of decodes alone (a CUDA graph's step) does not admit one sequence at a time; a
    step with a prompt chunk in it, or one after max_admit_delay_steps of waiting, does. The batch asked for is
    at most one per RUNNING_PER_ADMITTED running sequences, so a lightly loaded engine admits at once."""
    policy = small_policy(num_pages=256, max_num_batched_tokens=64, max_num_seqs=2 * RUNNING_PER_ADMITTED + 2)
    policy.min_admit_batch, policy.max_admit_delay_steps = 2, 3
    running = [new_seq(i, 1) for i in range(policy.max_num_seqs)]
    for seq in running:
        policy.add(seq)
    step(policy, now=1.0)
    late = new_seq(100, 5)
    policy.add(late)
    policy.finish(running[0], now=2.0)  # one seat free: fewer than min_admit_batch
    for n in range(3):
        plan = step(policy, now=3.0 + n)
        assert plan.admitted == [] and all(item.num_new_tokens == 1 for item in plan.items)
    assert step(policy, now=6.0).admitted == [late]  # the delay ran out
    assert policy.num_deferred_steps == 0
    a, b = new_seq(101, 5), new_seq(102, 5)
    policy.add(a)
    policy.add(b)
    policy.finish(running[1], now=7.0)
    policy.finish(running[2], now=7.0)  # two seats and two waiting: admitted at once
    assert step(policy, now=8.0).admitted == [a, b]
    for seq in running[3:3 + RUNNING_PER_ADMITTED + 2]:  # few running now: one waiting sequence starts at once
        policy.finish(seq, now=9.0)
    alone = new_seq(103, 5)
    policy.add(alone)
    assert len(policy.running) < 2 * RUNNING_PER_ADMITTED and step(policy, now=10.0).admitted == [alone]
