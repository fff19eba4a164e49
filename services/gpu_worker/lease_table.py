"""Leases on a prefill worker: which request's prompt pages are held for which decode worker, and until when
(pure: ids and times passed in).

A lease starts when the prefill side sends KVReady and ends exactly once: released by the decode side
(ReleaseLease), aborted, or expired. Whoever ends it frees the held pages (the engine's release_held).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    page_ids: tuple[int, ...]
    expires_s: float  # unix time
    decode_worker_id: str = ""


class LeaseTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}
        self._expiry: list[tuple[float, str]] = []  # (expires_s, lease_id); stale entries skipped lazily

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def num_pages(self) -> int:
        return sum(len(lease.page_ids) for lease in self._by_id.values())

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def is_valid(self, lease_id: str, now_s: float) -> bool:
        lease = self._by_id.get(lease_id)
        return lease is not None and now_s < lease.expires_s

    def grant(self, lease: Lease) -> None:
        if lease.lease_id in self._by_id or lease.request_id in self._by_request:
            raise ValueError(f"lease {lease.lease_id!r} or its request {lease.request_id!r} already leased")
        self._by_id[lease.lease_id] = lease
        self._by_request[lease.request_id] = lease.lease_id
        heapq.heappush(self._expiry, (lease.expires_s, lease.lease_id))

    def release(self, lease_id: str) -> Lease | None:
        """End a lease (released or aborted); None if it already ended."""
        lease = self._by_id.pop(lease_id, None)
        if lease is not None:
            del self._by_request[lease.request_id]
        return lease

    def release_request(self, request_id: str) -> Lease | None:
        lease_id = self._by_request.get(request_id)
        return None if lease_id is None else self.release(lease_id)

    def expire(self, now_s: float) -> list[Lease]:
        """End and return every lease whose time is up (now_s >= expires_s), earliest first."""
        expired = []
        while self._expiry and self._expiry[0][0] <= now_s:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self.release(lease_id)
            if lease is not None:
                expired.append(lease)
        return expired

    def next_expiry_s(self) -> float | None:
        """When the earliest live lease expires (None without leases)."""
        while self._expiry and self._expiry[0][1] not in self._by_id:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None

    def check_invariants(self) -> None:
        assert len(self._by_id) == len(self._by_request)
        for request_id, lease_id in self._by_request.items():
            assert self._by_id[lease_id].request_id == request_id
        live = {lease_id for _, lease_id in self._expiry}
        assert set(self._by_id) <= live, "a live lease is missing from the expiry heap"
