"""RadixCache: scripted scenarios pinning page ids and KV events, plus a random-operation state machine."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.gpu_worker.block_pool import BlockPool
from services.gpu_worker.radix_cache import NodeHandle, PrefixMatch, RadixCache
from shared.hashing import hash_blocks
from shared.messages import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

SALT = "test-model"
A = list(range(1, 13))  # three pages of 4
B = [1, 2, 3, 4, 50, 51, 52, 53, 54, 55, 56, 57]  # shares A's first page


def make_cache(num_pages: int = 16, is_enabled: bool = True) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_pages)
    return pool, RadixCache(pool, 4, SALT, is_enabled=is_enabled)


def hashes(token_ids: list[int], parent_hash: int | None = None) -> list[int]:
    return hash_blocks(token_ids, 4, SALT, parent_hash)


def check(pool: BlockPool, cache: RadixCache) -> None:
    pool.check_invariants()
    cache.check_invariants()


def test_insert_then_match() -> None:
    pool, cache = make_cache()
    pages = pool.allocate(3)
    result = cache.insert(A[:10], pages, now=1.0)
    assert pages == [1, 2, 3] and result.num_new_pages == 2
    assert [pool.ref_count(p) for p in pages] == [2, 2, 1]
    assert cache.drain_events() == [BlocksStored(hashes(A[:8]), None, A[:8], 4)]
    assert cache.drain_events() == []
    match = cache.match_prefix(A[:8] + [77, 78], now=2.0)
    assert (match.page_ids, match.num_tokens, match.node) == ([1, 2], 8, result.node)
    empty = cache.match_prefix([1, 2, 3], now=3.0)
    assert (empty.page_ids, empty.num_tokens, empty.node) == ([], 0, cache.root)
    assert cache.num_cached_pages == 2 and cache.num_evictable_pages == 2
    check(pool, cache)


def test_reinsert_keeps_tree_pages_and_emits_nothing() -> None:
    pool, cache = make_cache()
    first = cache.insert(A, pool.allocate(3), now=1.0)
    cache.drain_events()
    dup_pages = pool.allocate(3)
    again = cache.insert(A, dup_pages, now=2.0)
    assert (again.node, again.num_new_pages) == (first.node, 0)
    assert cache.drain_events() == []
    assert pool.free(dup_pages) == 3
    assert cache.match_prefix(A, now=3.0).page_ids == [1, 2, 3]
    check(pool, cache)


def test_insert_after_a_node_walks_only_the_pages_past_it() -> None:
    """A growing sequence's insert from its own node: the same tree, events and page refs as from the root; the
    result names the tree's page of each page past that node (another sequence's copy where it came first), and the
    nodes above are touched as a walk from the root would touch them."""
    pool, cache = make_cache()
    first = cache.insert(A[:4], pool.allocate(1), now=1.0)  # page 1: A's first page
    other = cache.insert(A[:8], [1] + pool.allocate(1), now=2.0)  # another sequence adds page 2 (A's second)
    cache.drain_events()
    mine = pool.allocate(2)  # this sequence's own copy of A's second page, and its third
    grown = cache.insert(A, [1] + mine, now=3.0, after=first.node)
    assert grown.page_ids == [2, mine[1]] and grown.num_new_pages == 1
    assert cache.drain_events() == [BlocksStored(hashes(A[8:], hashes(A[:8])[-1]), hashes(A[:8])[-1], A[8:], 4)]
    assert cache.match_prefix(A, now=4.0).page_ids == [1, 2, mine[1]]
    assert first.node.last_access == 4.0 and other.node.last_access == 4.0
    nothing = cache.insert(A + [90, 91], [1, 2, mine[1]], now=5.0, after=grown.node)  # no full page past it
    assert (nothing.node, nothing.page_ids, nothing.num_new_pages) == (grown.node, [], 0)
    assert first.node.last_access == 5.0
    pool.free([mine[0]])
    check(pool, cache)


def test_insert_after_a_node_deeper_than_the_tokens_walks_from_the_root() -> None:
    pool, cache = make_cache()
    deep = cache.insert(A, pool.allocate(3), now=1.0)
    again = cache.insert(A[:4], [1], now=2.0, after=deep.node)
    assert again.page_ids == [1] and again.num_new_pages == 0
    check(pool, cache)


def test_diverge_splits_edge_at_page_boundary() -> None:
    pool, cache = make_cache()
    a_pages = pool.allocate(3)
    cache.insert(A, a_pages, now=1.0)
    b_pages = pool.allocate(3)
    assert b_pages == [4, 5, 6]
    result = cache.insert(B, b_pages, now=2.0)
    assert result.num_new_pages == 2
    h_a = hashes(A)
    assert cache.drain_events() == [
        BlocksStored(h_a, None, A, 4),
        BlocksStored(hashes(B[4:], parent_hash=h_a[0]), h_a[0], B[4:], 4),
    ]
    assert hashes(B[4:], parent_hash=h_a[0]) == hashes(B)[1:]
    assert cache.match_prefix(A, now=3.0).page_ids == [1, 2, 3]
    assert cache.match_prefix(B, now=3.0).page_ids == [1, 5, 6]
    assert cache.match_prefix(A[:4] + [9, 9, 9, 9], now=3.0).page_ids == [1]
    assert pool.free(a_pages) == 0 and pool.free(b_pages) == 1
    assert [pool.ref_count(p) for p in range(1, 7)] == [1, 1, 1, 0, 1, 1]
    assert cache.num_cached_pages == 5
    check(pool, cache)


def test_match_ending_inside_edge_locks_only_matched_pages() -> None:
    pool, cache = make_cache()
    pages = pool.allocate(3)
    cache.insert(A, pages, now=1.0)
    pool.free(pages)
    match = cache.match_prefix(A[:4] + [99] * 4, now=2.0)
    assert (match.page_ids, match.num_tokens) == ([1], 4)
    cache.lock(match.node)
    assert cache.num_evictable_pages == 2
    cache.drain_events()
    assert cache.evict(10) == 2
    assert cache.drain_events() == [BlocksRemoved(hashes(A)[1:])]
    assert cache.match_prefix(A, now=3.0).page_ids == [1]
    check(pool, cache)


def test_lock_prevents_eviction() -> None:
    pool, cache = make_cache()
    pages = pool.allocate(3)
    result = cache.insert(A, pages, now=1.0)
    cache.lock(result.node)
    pool.free(pages)
    cache.drain_events()
    assert cache.num_evictable_pages == 0
    assert cache.evict(10) == 0
    assert cache.drain_events() == []
    cache.unlock(result.node)
    assert cache.num_evictable_pages == 3
    assert cache.evict(10) == 3
    assert cache.drain_events() == [BlocksRemoved(hashes(A))]
    assert pool.num_free == 15 and cache.num_cached_pages == 0
    with pytest.raises(ValueError):
        cache.unlock(result.node)
    with pytest.raises(ValueError):
        cache.lock(result.node)
    check(pool, cache)


def test_locked_branch_survives_while_sibling_is_evicted() -> None:
    pool, cache = make_cache()
    a_pages, b_pages = pool.allocate(3), pool.allocate(3)
    cache.insert(A, a_pages, now=1.0)
    b_node = cache.insert(B, b_pages, now=2.0).node
    cache.lock(b_node)
    pool.free(a_pages + b_pages)
    cache.drain_events()
    assert cache.evict(100) == 2
    assert cache.drain_events() == [BlocksRemoved(hashes(A)[1:])]
    assert sorted(cache.cached_blocks().values()) == [1, 5, 6]
    check(pool, cache)


def test_evicts_least_recently_used_first() -> None:
    pool, cache = make_cache()
    x, y, z = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    for now, token_ids in enumerate([x, y, z], start=1):
        pages = pool.allocate(1)
        cache.insert(token_ids, pages, now=float(now))
        pool.free(pages)
    cache.match_prefix(x, now=4.0)
    cache.drain_events()
    removed = []
    for _ in range(3):
        assert cache.evict(1) == 1
        [event] = cache.drain_events()
        removed.append(event)
    assert removed == [BlocksRemoved(hashes(y)), BlocksRemoved(hashes(z)), BlocksRemoved(hashes(x))]
    assert cache.evict(1) == 0
    check(pool, cache)


def test_eviction_reads_a_heap_not_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """evict() pops the LRU heap: with the tree walk disabled it still evicts oldest first, so its cost per
    page does not grow with the number of cached nodes."""
    pool, cache = make_cache(num_pages=40)
    for now in range(1, 9):  # eight one-page leaves, then each grown by one page (a chain, as decodes leave)
        tokens = [100 * now + t for t in range(8)]
        pages = pool.allocate(2)
        cache.insert(tokens[:4], pages[:1], now=float(now))
        cache.insert(tokens, pages, now=float(now) + 0.5)
        pool.free(pages)
    cache.match_prefix([100 + t for t in range(8)], now=20.0)  # the first request becomes the newest
    cache.drain_events()

    def no_walk() -> None:
        raise AssertionError("evict walked the tree")
    monkeypatch.setattr(cache, "_iter_nodes", no_walk)
    assert cache.evict(3) == 3
    second = [200 + t for t in range(8)]
    third = [300 + t for t in range(8)]
    assert cache.drain_events() == [BlocksRemoved(hashes(second)[1:]), BlocksRemoved(hashes(second)[:1]),
                                    BlocksRemoved(hashes(third)[1:])]
    monkeypatch.undo()
    check(pool, cache)


def test_heap_of_a_touched_leaf_stays_bounded() -> None:
    """Each touch of an evictable leaf pushes a heap entry; stale ones are compacted away."""
    pool, cache = make_cache()
    pages = pool.allocate(1)
    cache.insert(A[:4], pages, now=1.0)
    pool.free(pages)
    for now in range(2, 1000):
        cache.match_prefix(A[:4], now=float(now))
    assert len(cache._lru) <= 2 + 64
    check(pool, cache)
    assert cache.evict(1) == 1


def test_evicts_tail_of_edge_first_then_parent_leaf() -> None:
    pool, cache = make_cache()
    pages = pool.allocate(3)
    cache.insert(A, pages, now=1.0)
    pool.free(pages)
    cache.drain_events()
    assert cache.evict(1) == 1
    assert pool.ref_count(3) == 0 and pool.ref_count(2) == 1
    assert cache.drain_events() == [BlocksRemoved(hashes(A)[2:])]
    assert cache.match_prefix(A, now=2.0).page_ids == [1, 2]
    assert cache.evict(5) == 2
    assert cache.drain_events() == [BlocksRemoved(hashes(A)[:2])]
    check(pool, cache)


def test_evict_counts_only_pages_returned_to_free_list() -> None:
    pool, cache = make_cache()
    pages = pool.allocate(3)
    cache.insert(A, pages, now=1.0)
    cache.drain_events()
    assert cache.evict(2) == 0
    assert cache.drain_events() == [BlocksRemoved(hashes(A))]
    assert cache.num_cached_pages == 0
    assert pool.free(pages) == 3
    check(pool, cache)


def test_partial_page_is_ignored() -> None:
    pool, cache = make_cache()
    pages = pool.allocate(2)
    result = cache.insert(A[:7], pages, now=1.0)
    assert result.num_new_pages == 1
    assert cache.drain_events() == [BlocksStored(hashes(A[:4]), None, A[:4], 4)]
    assert (pool.ref_count(1), pool.ref_count(2)) == (2, 1)
    match = cache.match_prefix(A[:7], now=2.0)
    assert (match.page_ids, match.num_tokens) == ([1], 4)
    assert cache.insert(A[:3], [], now=3.0).node is cache.root
    check(pool, cache)


def test_insert_needs_a_page_per_full_page() -> None:
    pool, cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert(A, pool.allocate(2), now=1.0)


def test_disabled_cache_adopts_and_emits_nothing() -> None:
    pool, cache = make_cache(is_enabled=False)
    pages = pool.allocate(3)
    result = cache.insert(A, pages, now=1.0)
    assert (result.node, result.num_new_pages) == (cache.root, 0)
    assert [pool.ref_count(p) for p in pages] == [1, 1, 1]
    match = cache.match_prefix(A, now=2.0)
    assert (match.page_ids, match.num_tokens, match.node) == ([], 0, cache.root)
    cache.lock(match.node)
    cache.unlock(match.node)
    assert cache.drain_events() == [] and cache.num_cached_pages == 0
    assert cache.evict(3) == 0
    check(pool, cache)


def test_clear_requires_no_locks_and_drops_everything() -> None:
    pool, cache = make_cache()
    a_pages, b_pages = pool.allocate(3), pool.allocate(3)
    cache.insert(A, a_pages, now=1.0)
    b_node = cache.insert(B, b_pages, now=2.0).node
    cache.lock(b_node)
    with pytest.raises(ValueError):
        cache.clear()
    cache.unlock(b_node)
    cache.drain_events()
    cache.clear()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.num_cached_pages == 0 and cache.cached_blocks() == {}
    assert pool.free(a_pages + b_pages) == 6 and pool.num_free == 15
    with pytest.raises(ValueError):
        cache.lock(b_node)
    check(pool, cache)


PAGE_SIZE = 2
NUM_PAGES = 20
token_lists = st.lists(st.integers(0, 2), max_size=11)
picks = st.integers(0, 1 << 16)


@dataclass
class LiveSequence:
    token_ids: list[int]
    own_page_ids: list[int]  # pages this sequence allocated and holds one ref on
    page_ids: list[int]  # its page table: matched tree pages, then its own
    node: NodeHandle
    num_extra_locks: int = 0
    pinned: dict[int, int] = field(default_factory=dict)  # block hash -> page id that must stay cached


class RadixCacheMachine(RuleBasedStateMachine):
    """Random insert/match/lock/unlock/evict/alloc/free/clear against an event-replay model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_PAGES)
        self.cache = RadixCache(self.pool, PAGE_SIZE, SALT)
        self.sequences: list[LiveSequence] = []
        self.raw_page_ids: list[int] = []
        self.replayed: dict[int, int | None] = {}
        self.now = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def expected_match_pages(self, token_ids: list[int]) -> int:
        num_pages = 0
        for block_hash in hash_blocks(token_ids, PAGE_SIZE, SALT):
            if block_hash not in self.replayed:
                break
            num_pages += 1
        return num_pages

    def checked_match(self, token_ids: list[int]) -> PrefixMatch:
        num_expected = self.expected_match_pages(token_ids)
        cached = self.cache.cached_blocks()
        match = self.cache.match_prefix(token_ids, now=self.tick())
        assert len(match.page_ids) == num_expected
        assert match.num_tokens == num_expected * PAGE_SIZE
        block_hashes = hash_blocks(token_ids, PAGE_SIZE, SALT)[:num_expected]
        assert match.page_ids == [cached[h] for h in block_hashes]
        return match

    def pick(self, index: int) -> LiveSequence:
        return self.sequences[index % len(self.sequences)]

    @rule(token_ids=token_lists)
    def start_sequence(self, token_ids: list[int]) -> None:
        match = self.checked_match(token_ids)
        self.cache.lock(match.node)
        num_needed = -(-len(token_ids) // PAGE_SIZE) - len(match.page_ids)
        if num_needed > self.pool.num_free:
            self.check_evict(num_needed - self.pool.num_free)
        if num_needed > self.pool.num_free:
            self.cache.unlock(match.node)
            return
        own = self.pool.allocate(num_needed)
        block_hashes = hash_blocks(token_ids, PAGE_SIZE, SALT)
        pinned = dict(zip(block_hashes, match.page_ids))
        self.sequences.append(LiveSequence(token_ids, own, match.page_ids + own, match.node, pinned=pinned))

    @precondition(lambda self: self.sequences)
    @rule(index=picks)
    def insert_sequence(self, index: int) -> None:
        seq = self.pick(index)
        cached = self.cache.cached_blocks()
        block_hashes = hash_blocks(seq.token_ids, PAGE_SIZE, SALT)
        expected_pages = [cached.get(h, p) for h, p in zip(block_hashes, seq.page_ids)]
        result = self.cache.insert(seq.token_ids, seq.page_ids, now=self.tick())
        assert result.num_new_pages == sum(h not in cached for h in block_hashes)
        for _ in range(1 + seq.num_extra_locks):
            self.cache.lock(result.node)
            self.cache.unlock(seq.node)
        seq.node = result.node
        seq.pinned = dict(zip(block_hashes, expected_pages))
        assert self.cache.cached_blocks().items() >= seq.pinned.items()

    @precondition(lambda self: self.sequences)
    @rule(index=picks)
    def finish_sequence(self, index: int) -> None:
        seq = self.pick(index)
        self.pool.free(seq.own_page_ids)
        for _ in range(1 + seq.num_extra_locks):
            self.cache.unlock(seq.node)
        self.sequences.remove(seq)

    @precondition(lambda self: self.sequences)
    @rule(index=picks)
    def lock_again(self, index: int) -> None:
        seq = self.pick(index)
        self.cache.lock(seq.node)
        seq.num_extra_locks += 1

    @precondition(lambda self: any(seq.num_extra_locks for seq in self.sequences))
    @rule(index=picks)
    def unlock_extra(self, index: int) -> None:
        locked = [seq for seq in self.sequences if seq.num_extra_locks]
        seq = locked[index % len(locked)]
        self.cache.unlock(seq.node)
        seq.num_extra_locks -= 1

    @rule(token_ids=token_lists)
    def match_only(self, token_ids: list[int]) -> None:
        self.checked_match(token_ids)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self.check_evict(num_pages)

    def check_evict(self, num_pages: int) -> None:
        """evict() frees what it reports, and the first leaf it cuts is a least recently used one."""
        for event in self.cache.drain_events():
            self.replay(event)
        leaf_ages = {h: node.last_access for node in self.cache._iter_nodes() if self.cache._is_evictable_leaf(node)
                     for h in node.block_hashes}
        num_free_before = self.pool.num_free
        num_freed = self.cache.evict(num_pages)
        events = self.cache.drain_events()
        removed = [event for event in events if isinstance(event, BlocksRemoved)]
        if removed:
            assert leaf_ages[removed[0].block_hashes[-1]] == min(leaf_ages.values())
        for event in events:
            self.replay(event)
        assert self.pool.num_free - num_free_before == num_freed
        assert num_freed <= max(num_pages, 0)
        if num_freed < num_pages:
            assert self.cache.num_evictable_pages == 0

    @rule(num_pages=st.integers(1, 3))
    def alloc_raw(self, num_pages: int) -> None:
        if num_pages <= self.pool.num_free:
            self.raw_page_ids += self.pool.allocate(num_pages)

    @precondition(lambda self: self.raw_page_ids)
    @rule(index=picks)
    def free_raw(self, index: int) -> None:
        self.pool.free([self.raw_page_ids.pop(index % len(self.raw_page_ids))])

    @precondition(lambda self: not self.sequences)
    @rule()
    def clear(self) -> None:
        self.cache.clear()

    def replay(self, event: KVEvent) -> None:
        if isinstance(event, BlocksStored):
            assert event.parent_hash is None or event.parent_hash in self.replayed
            expected = hash_blocks(event.token_ids, event.page_size, SALT, event.parent_hash)
            assert event.block_hashes == expected
            parents = [event.parent_hash] + event.block_hashes[:-1]
            for block_hash, parent_hash in zip(event.block_hashes, parents):
                assert block_hash not in self.replayed
                self.replayed[block_hash] = parent_hash
        elif isinstance(event, BlocksRemoved):
            assert event.block_hashes
            for block_hash in event.block_hashes:
                del self.replayed[block_hash]
            assert not set(self.replayed.values()) & set(event.block_hashes), "removed a non-leaf block"
        else:
            assert isinstance(event, AllBlocksCleared)
            self.replayed.clear()

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        self.cache.check_invariants()
        for event in self.cache.drain_events():
            self.replay(event)
        cached = self.cache.cached_blocks()
        assert set(self.replayed) == set(cached)
        expected_refs = Counter(cached.values()) + Counter(self.raw_page_ids)
        for seq in self.sequences:
            expected_refs.update(seq.own_page_ids)
            assert cached.items() >= seq.pinned.items(), "a locked page was evicted"
        assert all(self.pool.ref_count(p) == expected_refs[p] for p in range(1, NUM_PAGES))
        assert self.pool.num_used == len(expected_refs)


RadixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRadixCacheMachine = RadixCacheMachine.TestCase
