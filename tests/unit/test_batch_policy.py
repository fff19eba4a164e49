"""BatchPolicy against a full prefix cache: growing decodes take their pages from eviction, in batches."""
from __future__ import annotations

from services.gpu_worker.batch_policy import EVICT_BATCH_FRACTION, BatchPolicy
from services.gpu_worker.block_pool import BlockPool
from services.gpu_worker.radix_cache import RadixCache
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.sequence import Sequence

PAGE_SIZE = 4
NUM_PAGES = 1 + 1024


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
    policy.after_step(plan, now=5001.0)
    policy.schedule(now=5002.0)  # the decode needs a fifth page: one short, so 1 + 4 are evicted
    assert seq.page_ids == [1021, 1022, 1023, 1024, 5]  # the five least recently used leaves went, oldest first
    assert [policy.pool.ref_count(p) for p in range(1, 7)] == [0, 0, 0, 0, 1, 1]
    assert policy.pool.num_free == 4
    assert policy.cache.num_cached_pages == 1020 + 4 - 5
    policy.pool.check_invariants()
    policy.cache.check_invariants()
