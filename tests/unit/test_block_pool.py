"""BlockPool: reserved page 0, all-or-nothing allocation, ref counting, invariants under random use."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.block_pool import BlockPool, OutOfPages


def test_page_zero_is_reserved() -> None:
    pool = BlockPool(5)
    assert pool.capacity == 4
    assert pool.num_free == 4 and pool.num_used == 0
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert pool.num_free == 0 and pool.num_used == 4
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    with pytest.raises(ValueError):
        pool.incref([0])
    with pytest.raises(ValueError):
        pool.free([0])
    pool.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [1, 2]
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_ref_counting_and_reuse_order() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert [pool.ref_count(p) for p in a] == [1, 1, 1]
    pool.incref([a[0], a[0], a[1]])
    assert [pool.ref_count(p) for p in a] == [3, 2, 1]
    assert pool.free(a) == 1
    assert pool.ref_count(a[2]) == 0
    assert pool.allocate(1) == [a[2]]
    assert pool.free([a[0], a[0], a[1]]) == 2
    assert pool.num_used == 1
    pool.check_invariants()


def test_free_of_free_page_raises_without_changes() -> None:
    pool = BlockPool(4)
    [page_id] = pool.allocate(1)
    pool.free([page_id])
    with pytest.raises(ValueError):
        pool.free([page_id])
    other = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free(other + other)
    assert pool.ref_count(other[0]) == 1
    with pytest.raises(ValueError):
        pool.incref([other[0], 3])
    assert pool.ref_count(other[0]) == 1
    pool.check_invariants()


def test_rejects_too_small_pool() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 5), st.integers(0, 99)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_use_keeps_exact_counts(operations: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(10)
    refs: Counter[int] = Counter()
    for op, num, pick in operations:
        held = sorted(refs)
        if op == "alloc":
            if num > pool.num_free:
                with pytest.raises(OutOfPages):
                    pool.allocate(num)
            else:
                refs.update(pool.allocate(num))
        elif held and op == "incref":
            pool.incref([held[pick % len(held)]])
            refs[held[pick % len(held)]] += 1
        elif held:
            page_id = held[pick % len(held)]
            assert pool.free([page_id]) == (refs[page_id] == 1)
            refs[page_id] -= 1
            refs += Counter()
        pool.check_invariants()
        assert all(pool.ref_count(p) == refs[p] for p in range(1, 10))
        assert pool.num_used == len(refs)
