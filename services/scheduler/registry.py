"""The workers a scheduler knows, from their heartbeats: address, model, role, last load and last sign of life
(pure: times passed in)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.messages import WorkerHeartbeat, WorkerLoad


class HeartbeatKind(enum.Enum):
    NEW = "new"              # a worker id not seen before (or seen, expired and back)
    UPDATED = "updated"      # the same incarnation, fresh load
    RESTARTED = "restarted"  # a known worker id with a new incarnation: its old requests are lost


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    incarnation: str
    addr: str
    model_id: str
    role: str
    page_size: int
    load: WorkerLoad
    last_seen_s: float
    is_draining: bool = False  # the worker is stopping: it finishes its requests and takes no new ones

    def is_alive(self, now_s: float, timeout_s: float) -> bool:
        return now_s - self.last_seen_s <= timeout_s


class Registry:
    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def workers(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def model_ids(self) -> list[str]:
        return sorted({w.model_id for w in self._workers.values()})

    def on_heartbeat(self, hb: WorkerHeartbeat, now_s: float) -> tuple[HeartbeatKind, WorkerInfo | None]:
        """Record a heartbeat; returns its kind and, on RESTARTED, the replaced incarnation's entry."""
        old = self._workers.get(hb.worker_id)
        self._workers[hb.worker_id] = WorkerInfo(hb.worker_id, hb.incarnation, hb.addr, hb.model_id, hb.role,
                                                 hb.page_size, hb.load, now_s, hb.is_draining)
        if old is None:
            return HeartbeatKind.NEW, None
        if old.incarnation != hb.incarnation:
            return HeartbeatKind.RESTARTED, old
        return HeartbeatKind.UPDATED, None

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def expire(self, now_s: float, timeout_s: float) -> list[WorkerInfo]:
        """Remove and return (by id) every worker silent for more than timeout_s."""
        dead = sorted((w for w in self._workers.values() if not w.is_alive(now_s, timeout_s)),
                      key=lambda w: w.worker_id)
        for worker in dead:
            del self._workers[worker.worker_id]
        return dead

    def check_invariants(self) -> None:
        for worker_id, worker in self._workers.items():
            assert worker.worker_id == worker_id
            assert worker.page_size >= 1, worker_id
