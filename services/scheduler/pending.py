"""Pending prefix entries: the block hashes of requests this scheduler routed in the last ttl_s, by worker
(pure: times passed in).

A routed prompt's blocks reach the global index only after the worker has prefilled them and cache_index
has applied its KV events. Until then this short-lived memory, merged with the index's answer, lets a burst
of requests sharing a new prefix follow the first one instead of being sprayed across workers.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence


class PendingPrefixes:
    def __init__(self, ttl_s: float, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries  # (block, worker) pairs; beyond it the oldest go early
        self._expiry_s: dict[int, dict[str, float]] = {}  # block hash → {worker_id: expiry}
        self._num_entries = 0
        self._order: deque[tuple[float, str, tuple[int, ...]]] = deque()  # (expiry_s, worker, hashes), by time

    def __len__(self) -> int:
        return self._num_entries

    def add(self, block_hashes: Sequence[int], worker_id: str, now_s: float) -> None:
        """Remember that worker_id will hold block_hashes (a chain) until now_s + ttl_s."""
        if not block_hashes:
            return
        expiry_s = now_s + self.ttl_s
        for block_hash in block_hashes:
            holders = self._expiry_s.setdefault(block_hash, {})
            self._num_entries += worker_id not in holders
            holders[worker_id] = expiry_s
        self._order.append((expiry_s, worker_id, tuple(block_hashes)))
        while self._num_entries > self.max_entries:
            self._drop_oldest()

    def expire(self, now_s: float) -> None:
        """Forget every entry whose time is up."""
        while self._order and self._order[0][0] <= now_s:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        expiry_s, worker_id, block_hashes = self._order.popleft()
        for block_hash in block_hashes:
            holders = self._expiry_s.get(block_hash)
            if holders is not None and holders.get(worker_id) == expiry_s:  # not refreshed by a later add
                del holders[worker_id]
                self._num_entries -= 1
                if not holders:
                    del self._expiry_s[block_hash]

    def longest_prefix(self, block_hashes: Sequence[int], now_s: float) -> dict[str, int]:
        """{worker_id: leading blocks of this chain it has pending} for each worker pending the first block."""
        self.expire(now_s)
        if not block_hashes:
            return {}
        alive = set(self._expiry_s.get(block_hashes[0], ()))
        result: dict[str, int] = {}
        for depth, block_hash in enumerate(block_hashes[1:], start=1):
            holders = self._expiry_s.get(block_hash, {})
            for worker_id in [w for w in alive if w not in holders]:
                alive.discard(worker_id)
                result[worker_id] = depth
            if not alive:
                break
        result.update({worker_id: len(block_hashes) for worker_id in alive})
        return result

    def check_invariants(self) -> None:
        assert self._num_entries == sum(len(h) for h in self._expiry_s.values())
        assert all(self._expiry_s.values()), "no empty holder maps"
        assert all(a[0] <= b[0] for a, b in zip(self._order, list(self._order)[1:])), "order by expiry"
        latest = {(h, w): e for e, w, hs in self._order for h in hs}
        for block_hash, holders in self._expiry_s.items():
            for worker_id, expiry_s in holders.items():
                assert latest[(block_hash, worker_id)] == expiry_s


def merge_prefixes(*views: Mapping[str, int]) -> dict[str, int]:
    """Per worker, the longest prefix any view gives it."""
    merged: dict[str, int] = {}
    for view in views:
        for worker_id, num_blocks in view.items():
            merged[worker_id] = max(merged.get(worker_id, 0), num_blocks)
    return merged
