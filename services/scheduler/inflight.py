"""The in-flight table: which worker each routed request went to and where its errors go, indexed by worker
so a dead worker's requests can all be failed (pure)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InFlight:
    request_id: str
    worker_id: str
    reply_addr: str


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

    def add(self, request_id: str, worker_id: str, reply_addr: str) -> None:
        """Record a routed request (a request id routed again replaces its old entry)."""
        self.pop(request_id)
        self._by_request[request_id] = InFlight(request_id, worker_id, reply_addr)
        self._by_worker.setdefault(worker_id, set()).add(request_id)

    def pop(self, request_id: str) -> InFlight | None:
        entry = self._by_request.pop(request_id, None)
        if entry is not None:
            ids = self._by_worker[entry.worker_id]
            ids.discard(request_id)
            if not ids:
                del self._by_worker[entry.worker_id]
        return entry

    def pop_worker(self, worker_id: str) -> list[InFlight]:
        """Remove and return (by request id) every request in flight on worker_id."""
        ids = sorted(self._by_worker.pop(worker_id, ()))
        return [self._by_request.pop(request_id) for request_id in ids]

    def check_invariants(self) -> None:
        indexed = [(worker_id, rid) for worker_id, ids in self._by_worker.items() for rid in ids]
        assert len(indexed) == len(self._by_request)
        for worker_id, request_id in indexed:
            assert self._by_request[request_id].worker_id == worker_id
        assert all(self._by_worker.values()), "no empty per-worker sets"
