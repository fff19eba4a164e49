"""Reference-counted allocator of KV pages; page 0 is reserved padding and never handed out."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

RESERVED_PAGE_ID = 0


class OutOfPages(Exception):
    """Not enough free pages for an allocation (nothing was allocated)."""


class BlockPool:
    """Pages 1..num_pages-1 with O(1) allocate/free: a free-list stack plus a ref-count list."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._free_page_ids = list(range(num_pages - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free_page_ids)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def ref_count(self, page_id: int) -> int:
        self._check_page_id(page_id)
        return self._ref_counts[page_id]

    def allocate(self, num_pages: int) -> list[int]:
        """Hand out num_pages pages with ref count 1 each, all or nothing (lowest ids first when fresh)."""
        if num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        if num_pages > len(self._free_page_ids):
            raise OutOfPages(f"need {num_pages} pages, {len(self._free_page_ids)} free")
        page_ids = [self._free_page_ids.pop() for _ in range(num_pages)]
        for page_id in page_ids:
            self._ref_counts[page_id] = 1
        return page_ids

    def incref(self, page_ids: Iterable[int]) -> None:
        """Add one reference to each page; every page must already be in use (checked before any change)."""
        page_ids = list(page_ids)
        for page_id in page_ids:
            self._check_page_id(page_id)
            if self._ref_counts[page_id] == 0:
                raise ValueError(f"incref of free page {page_id}")
        for page_id in page_ids:
            self._ref_counts[page_id] += 1

    def free(self, page_ids: Iterable[int]) -> int:
        """Drop one reference per occurrence; return how many pages went back to the free list.

        Checked before any change: dropping more references than a page holds raises ValueError.
        """
        drops = Counter(page_ids)
        for page_id, num_drops in drops.items():
            self._check_page_id(page_id)
            if self._ref_counts[page_id] < num_drops:
                raise ValueError(f"free of page {page_id} with ref count {self._ref_counts[page_id]}")
        num_released = 0
        for page_id, num_drops in drops.items():
            self._ref_counts[page_id] -= num_drops
            if self._ref_counts[page_id] == 0:
                self._free_page_ids.append(page_id)
                num_released += 1
        return num_released

    def _check_page_id(self, page_id: int) -> None:
        if not 0 < page_id < self.num_pages:
            raise ValueError(f"page id {page_id} out of range 1..{self.num_pages - 1}")

    def check_invariants(self) -> None:
        free = set(self._free_page_ids)
        assert len(free) == len(self._free_page_ids), "duplicate page in free list"
        assert RESERVED_PAGE_ID not in free, "reserved page 0 in free list"
        assert self._ref_counts[RESERVED_PAGE_ID] == 0, "reserved page 0 referenced"
        assert all(count >= 0 for count in self._ref_counts), "negative ref count"
        referenced = {p for p, count in enumerate(self._ref_counts) if count > 0}
        assert not free & referenced, "page both free and referenced"
        assert free | referenced == set(range(1, self.num_pages)), "page neither free nor referenced"
