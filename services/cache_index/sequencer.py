"""Per-worker KV event ordering: which batches to apply, which are duplicates, and when a gap or a restart
means the index must resynchronise from a worker snapshot (pure: no I/O, times passed in)."""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from shared.messages import CacheSnapshot, KVEvent, KVEventBatch

MAX_RETIRED_INCARNATIONS = 8


class Action(enum.Enum):
    APPLY = "apply"                        # apply `events` on top of what the index holds
    RESET_AND_APPLY = "reset_and_apply"    # a new incarnation from seq 0: clear the worker, then apply
    DROP = "drop"                          # every event was applied before (or is from a retired incarnation)
    BUFFER = "buffer"                      # kept until the awaited snapshot arrives
    REQUEST_SNAPSHOT = "request_snapshot"  # gap or restart seen now: ask the worker, batch buffered


@dataclass(frozen=True)
class BatchDecision:
    action: Action
    events: list[KVEvent] = field(default_factory=list)  # to apply, duplicates already trimmed
    next_seq: int = 0  # the worker's next seq once `events` are applied (APPLY / RESET_AND_APPLY)


@dataclass(frozen=True)
class SnapshotDecision:
    is_accepted: bool
    events_after: list[KVEvent] = field(default_factory=list)  # buffered events to apply after the snapshot
    next_seq: int = 0  # the worker's next seq once the snapshot and events_after are applied
    needs_snapshot: bool = False  # the buffered events had a gap: another snapshot is needed


@dataclass
class WorkerSeq:
    incarnation: str
    worker_addr: str
    next_seq: int = 0
    is_awaiting_snapshot: bool = False
    snapshot_requested_s: float | None = None  # None while awaiting: a request is due now
    buffered: list[KVEventBatch] = field(default_factory=list)
    retired: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_RETIRED_INCARNATIONS))


class Sequencer:
    """Tracks, per worker id, the incarnation and next expected event number the index is exact up to."""

    def __init__(self, max_buffered_batches: int = 1024) -> None:
        self.max_buffered_batches = max_buffered_batches
        self._workers: dict[str, WorkerSeq] = {}

    def get(self, worker_id: str) -> WorkerSeq | None:
        return self._workers.get(worker_id)

    def restore(self, worker_id: str, incarnation: str, next_seq: int, worker_addr: str) -> None:
        """Resume a worker whose index (in Redis) is exact up to next_seq of incarnation."""
        self._workers[worker_id] = WorkerSeq(incarnation, worker_addr, next_seq)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def on_batch(self, batch: KVEventBatch, now_s: float) -> BatchDecision:
        state = self._workers.get(batch.worker_id)
        if state is not None and batch.incarnation in state.retired:
            return BatchDecision(Action.DROP)
        if state is None or state.incarnation != batch.incarnation:
            return self._on_new_incarnation(state, batch, now_s)
        state.worker_addr = batch.worker_addr
        if state.is_awaiting_snapshot:
            self._buffer(state, batch)
            return BatchDecision(Action.BUFFER)
        return self._on_next(state, batch, now_s)

    def _on_new_incarnation(self, old: WorkerSeq | None, batch: KVEventBatch, now_s: float) -> BatchDecision:
        state = WorkerSeq(batch.incarnation, batch.worker_addr)
        if old is not None:
            state.retired.extend(old.retired)
            state.retired.append(old.incarnation)
        self._workers[batch.worker_id] = state
        if batch.first_seq == 0:
            state.next_seq = len(batch.events)
            return BatchDecision(Action.RESET_AND_APPLY, list(batch.events), state.next_seq)
        self._await_snapshot(state, now_s)
        self._buffer(state, batch)
        return BatchDecision(Action.REQUEST_SNAPSHOT)

    def _on_next(self, state: WorkerSeq, batch: KVEventBatch, now_s: float) -> BatchDecision:
        end_seq = batch.first_seq + len(batch.events)
        if end_seq <= state.next_seq:
            return BatchDecision(Action.DROP)
        if batch.first_seq > state.next_seq:
            self._await_snapshot(state, now_s)
            self._buffer(state, batch)
            return BatchDecision(Action.REQUEST_SNAPSHOT)
        events = list(batch.events[state.next_seq - batch.first_seq:])
        state.next_seq = end_seq
        return BatchDecision(Action.APPLY, events, end_seq)

    def _await_snapshot(self, state: WorkerSeq, now_s: float | None) -> None:
        state.is_awaiting_snapshot = True
        state.snapshot_requested_s = now_s

    def _buffer(self, state: WorkerSeq, batch: KVEventBatch) -> None:
        if len(state.buffered) >= self.max_buffered_batches:
            state.buffered.clear()  # NOTE: replay after the snapshot then sees a gap and asks again
        state.buffered.append(batch)

    def on_snapshot(self, snapshot: CacheSnapshot, now_s: float) -> SnapshotDecision:
        """Accept a snapshot only while one is awaited and it is not from a retired incarnation; then
        replay the buffered batches numbered from its next_seq on."""
        state = self._workers.get(snapshot.worker_id)
        if state is None or not state.is_awaiting_snapshot or snapshot.incarnation in state.retired:
            return SnapshotDecision(is_accepted=False)
        if snapshot.incarnation != state.incarnation:
            state.retired.append(state.incarnation)
            state.incarnation = snapshot.incarnation
        buffered = sorted((b for b in state.buffered if b.incarnation == state.incarnation),
                          key=lambda b: b.first_seq)
        state.buffered, state.next_seq = [], snapshot.next_seq
        state.is_awaiting_snapshot, state.snapshot_requested_s = False, None
        events: list[KVEvent] = []
        for i, batch in enumerate(buffered):
            decision = self._on_next(state, batch, now_s)
            events.extend(decision.events)
            if decision.action is Action.REQUEST_SNAPSHOT:
                state.buffered.extend(buffered[i + 1:])
                return SnapshotDecision(True, events, state.next_seq, needs_snapshot=True)
        return SnapshotDecision(True, events, state.next_seq)

    def mark_needs_snapshot(self, worker_id: str) -> None:
        """The index of worker_id can no longer be trusted (a failed write): resynchronise it."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.buffered.clear()
            self._await_snapshot(state, None)

    def resync_all(self) -> list[str]:
        """The whole index was lost (Redis emptied): every worker not already awaiting a snapshot needs one.
        Returns their ids, sorted."""
        lost = sorted(w for w, state in self._workers.items() if not state.is_awaiting_snapshot)
        for worker_id in lost:
            self.mark_needs_snapshot(worker_id)
        return lost

    def due_snapshot_requests(self, now_s: float, retry_s: float) -> list[tuple[str, str]]:
        """(worker_id, worker_addr) of each awaited snapshot never requested or requested over retry_s
        ago; each is marked requested now."""
        due = []
        for worker_id, state in self._workers.items():
            requested_s = state.snapshot_requested_s
            if state.is_awaiting_snapshot and (requested_s is None or now_s - requested_s >= retry_s):
                state.snapshot_requested_s = now_s
                due.append((worker_id, state.worker_addr))
        return due

    def check_invariants(self) -> None:
        for worker_id, state in self._workers.items():
            assert state.next_seq >= 0, worker_id
            assert state.is_awaiting_snapshot or not state.buffered, worker_id
            assert state.is_awaiting_snapshot or state.snapshot_requested_s is None, worker_id
            assert len(state.buffered) <= self.max_buffered_batches, worker_id
            assert all(b.worker_id == worker_id for b in state.buffered), worker_id
            assert state.incarnation not in state.retired, worker_id
