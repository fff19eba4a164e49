"""The in-flight table: which worker each routed request went to and where its errors go, indexed by worker
so a dead worker's requests can all be failed (pure). Also the requests that ended while unknown here.

A PD request has two legs: its decode worker (worker_id, until it finishes) and its prefill worker
(prefill_worker_id, until the prefill side reports the handoff). Both legs index the request.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class InFlight:
    request_id: str
    worker_id: str
    reply_addr: str
    prefill_worker_id: str | None = None  # PD: the prefill leg, open until the handoff


class InFlightTable:
    def __init__(self) -> None:
        self._by_request: dict[str, InFlight] = {}
        self._by_worker: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def get(self, request_id: str) -> InFlight | None:
        return self._by_request.get(request_id)

    def count(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def add(self, request_id: str, worker_id: str, reply_addr: str, prefill_worker_id: str | None = None) -> None:
        """Record a routed request (a request id routed again replaces its old entry)."""
        self.pop(request_id)
        self._by_request[request_id] = InFlight(request_id, worker_id, reply_addr, prefill_worker_id)
        for leg in self._legs(self._by_request[request_id]):
            self._by_worker.setdefault(leg, set()).add(request_id)

    @staticmethod
    def _legs(entry: InFlight) -> set[str]:
        return {entry.worker_id} | ({entry.prefill_worker_id} if entry.prefill_worker_id else set())

    def _unindex(self, worker_id: str, request_id: str) -> None:
        ids = self._by_worker[worker_id]
        ids.discard(request_id)
        if not ids:
            del self._by_worker[worker_id]

    def pop(self, request_id: str) -> InFlight | None:
        entry = self._by_request.pop(request_id, None)
        if entry is not None:
            for leg in self._legs(entry):
                self._unindex(leg, request_id)
        return entry

    def close_prefill(self, request_id: str) -> InFlight | None:
        """The prefill worker handed the request off: only its decode leg stays."""
        entry = self._by_request.get(request_id)
        if entry is None or entry.prefill_worker_id is None:
            return entry
        if entry.prefill_worker_id != entry.worker_id:
            self._unindex(entry.prefill_worker_id, request_id)
        self._by_request[request_id] = InFlight(request_id, entry.worker_id, entry.reply_addr)
        return self._by_request[request_id]

    def pop_worker(self, worker_id: str) -> list[InFlight]:
        """Remove and return (by request id) every request with a leg on worker_id."""
        ids = sorted(self._by_worker.get(worker_id, ()))
        return [self.pop(request_id) for request_id in ids]

    def check_invariants(self) -> None:
        indexed = {(worker_id, rid) for worker_id, ids in self._by_worker.items() for rid in ids}
        expected = {(leg, rid) for rid, entry in self._by_request.items() for leg in self._legs(entry)}
        assert indexed == expected
        assert all(self._by_worker.values()), "no empty per-worker sets"


class RecentIds:
    """Ids of requests that ended while unknown here (aborted, or finished on a worker), each kept ttl_s (at most
    max_size: the oldest go first), so a request handed over later from a dead scheduler is not taken on after
    its end (pure: times passed in)."""

    def __init__(self, ttl_s: float, max_size: int = 65_536) -> None:
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._until: OrderedDict[str, float] = OrderedDict()  # oldest first: every entry lives ttl_s

    def __len__(self) -> int:
        return len(self._until)

    def add(self, request_id: str, now_s: float) -> None:
        if self.ttl_s <= 0:
            return
        self._until.pop(request_id, None)
        self._until[request_id] = now_s + self.ttl_s
        if len(self._until) > self.max_size:
            self._until.popitem(last=False)

    def pop(self, request_id: str, now_s: float) -> bool:
        """Forget request_id; True if it was still remembered."""
        until = self._until.pop(request_id, None)
        return until is not None and until >= now_s

    def expire(self, now_s: float) -> None:
        while self._until and next(iter(self._until.values())) < now_s:
            self._until.popitem(last=False)
