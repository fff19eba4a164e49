"""The cache_index actor shell: a PULL socket of KV events, snapshots and WorkerGone, written to the Redis
index in each worker's order; gaps, restarts and failed writes resynchronise from a worker snapshot, and a
Redis that lost the index (its epoch changed) is rebuilt from snapshots of every known worker. A cleared worker
is forgotten at once (its generation retired); its entries are collected in the background in bounded batches."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
import structlog
import zmq
import zmq.asyncio

from services.cache_index.config import CacheIndexConfig
from services.cache_index.sequencer import Action, BatchDecision, Sequencer, SnapshotDecision
from shared import redis_index, transport
from shared.actor import Actor
from shared.messages import CacheIndexInbound, CacheSnapshot, KVEventBatch, SnapshotRequest, WorkerGone

log = structlog.get_logger(__name__)

REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


class CacheIndexService(Actor):
    name = "cache_index"

    def __init__(self, config: CacheIndexConfig) -> None:
        super().__init__()
        self.config = config
        self.sequencer = Sequencer(config.max_buffered_batches)
        self._redis: aioredis.Redis | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reply_addr = config.cache_index_addr
        self._pushes = transport.PushPool()
        self._pending_clears: set[str] = set()  # workers gone whose clear failed; retried
        self._epoch: str | None = None  # the index epoch last seen in Redis (None: not read yet)
        self._handlers = {KVEventBatch: self._on_batch, CacheSnapshot: self._on_snapshot,
                          WorkerGone: self._on_worker_gone}

    async def start(self) -> None:
        self._redis = aioredis.from_url(self.config.redis_url, socket_timeout=self.config.redis_timeout_s,
                                        socket_connect_timeout=self.config.redis_timeout_s)
        self._pull = transport.bind(zmq.PULL, self.config.cache_index_addr)
        self._reply_addr = transport.advertised(transport.bound_addr(self._pull))
        self.spawn(transport.receive_forever(self._pull, CacheIndexInbound, self._dispatch), "receive")
        try:
            await self._check_epoch()
        except REDIS_ERRORS as exc:
            log.warning("redis unreachable at start; will retry", error=repr(exc))
        self.every(self.config.retry_interval_s, self._retry, "retry")
        self.every(self.config.gc_interval_s, self._collect_garbage, "collect_garbage")
        log.info("ready", addr=self._reply_addr, redis_url=self.config.redis_url)

    async def close(self) -> None:
        self._pushes.close()
        if self._pull is not None:
            self._pull.close(linger=0)
        if self._redis is not None:
            await self._redis.aclose()

    async def _dispatch(self, msg: msgspec.Struct, identity: bytes | None) -> None:
        await self._handlers[type(msg)](msg)

    async def _on_batch(self, batch: KVEventBatch) -> None:
        self._pending_clears.discard(batch.worker_id)
        if self.sequencer.get(batch.worker_id) is None:
            await self._restore(batch)
        decision = self.sequencer.on_batch(batch, time.monotonic())
        if decision.action is Action.REQUEST_SNAPSHOT:
            log.info("event gap or restart; requesting snapshot", worker_id=batch.worker_id,
                     first_seq=batch.first_seq, incarnation=batch.incarnation)
            await self._request_snapshot(batch.worker_id, batch.worker_addr)
        elif decision.action in (Action.APPLY, Action.RESET_AND_APPLY):
            await self._write(batch.worker_id, self._apply(batch, decision))

    async def _restore(self, batch: KVEventBatch) -> None:
        """A worker this process has not seen: resume from the index's meta (after a cache_index restart)."""
        try:
            meta = await redis_index.worker_meta(self._redis, batch.worker_id)
        except REDIS_ERRORS as exc:
            log.warning("redis error reading worker meta", worker_id=batch.worker_id, error=repr(exc))
            return
        if meta is not None:
            self.sequencer.restore(batch.worker_id, meta[0], meta[1], batch.worker_addr)

    async def _apply(self, batch: KVEventBatch, decision: BatchDecision) -> None:
        if decision.action is Action.RESET_AND_APPLY:
            await redis_index.clear_worker(self._redis, batch.worker_id)
        await redis_index.apply_events(self._redis, batch.worker_id, decision.events, batch.incarnation,
                                       decision.next_seq)

    async def _on_snapshot(self, snapshot: CacheSnapshot) -> None:
        decision = self.sequencer.on_snapshot(snapshot, time.monotonic())
        if not decision.is_accepted:
            log.info("ignored unrequested snapshot", worker_id=snapshot.worker_id, incarnation=snapshot.incarnation)
            return
        log.info("applying snapshot", worker_id=snapshot.worker_id, num_blocks=len(snapshot.block_hashes),
                 next_seq=snapshot.next_seq, num_replayed_events=len(decision.events_after))
        await self._write(snapshot.worker_id, self._apply_snapshot(snapshot, decision))
        state = self.sequencer.get(snapshot.worker_id)
        if decision.needs_snapshot and state is not None:
            await self._request_snapshot(snapshot.worker_id, state.worker_addr)

    async def _apply_snapshot(self, snapshot: CacheSnapshot, decision: SnapshotDecision) -> None:
        num_written = await redis_index.replace_worker(self._redis, snapshot.worker_id, snapshot.block_hashes,
                                                       snapshot.incarnation, snapshot.next_seq)
        log.info("snapshot applied", worker_id=snapshot.worker_id, num_blocks_changed=num_written)
        if decision.events_after:
            await redis_index.apply_events(self._redis, snapshot.worker_id, decision.events_after,
                                           snapshot.incarnation, decision.next_seq)

    async def _on_worker_gone(self, msg: WorkerGone) -> None:
        state = self.sequencer.get(msg.worker_id)
        if state is not None:
            self._pushes.drop(state.worker_addr)
        self.sequencer.forget(msg.worker_id)
        await self._clear(msg.worker_id)

    async def _clear(self, worker_id: str) -> bool:
        try:
            num_blocks = await redis_index.clear_worker(self._redis, worker_id)
        except REDIS_ERRORS as exc:
            log.warning("redis error clearing a gone worker; will retry", worker_id=worker_id, error=repr(exc))
            self._pending_clears.add(worker_id)
            return False
        self._pending_clears.discard(worker_id)
        log.info("cleared gone worker", worker_id=worker_id, num_blocks=num_blocks)
        return True

    async def _collect_garbage(self) -> None:
        """Periodic: remove the entries of retired generations, one bounded batch at a time with a pause between,
        so Redis answers lookups in between."""
        num_removed = 0
        try:
            while (removed := await redis_index.collect_garbage(self._redis, self.config.gc_batch_blocks)) is not None:
                num_removed += removed
                await asyncio.sleep(self.config.gc_pause_s)
        except REDIS_ERRORS as exc:
            log.warning("redis error collecting garbage; will retry", error=repr(exc))
        if num_removed:
            log.info("collected index garbage", num_entries=num_removed)

    async def _write(self, worker_id: str, write: Awaitable[None]) -> None:
        """Run one index write; if Redis fails, the worker's index is suspect until a snapshot lands."""
        try:
            await write
        except REDIS_ERRORS as exc:
            log.warning("redis write failed; worker needs a snapshot", worker_id=worker_id, error=repr(exc))
            self.sequencer.mark_needs_snapshot(worker_id)

    async def _request_snapshot(self, worker_id: str, worker_addr: str) -> None:
        if not worker_addr:
            return
        try:
            await self._pushes.send(worker_addr, SnapshotRequest(reply_addr=self._reply_addr))
        except zmq.ZMQError as exc:
            log.warning("cannot reach worker for a snapshot", worker_id=worker_id, addr=worker_addr, error=str(exc))

    async def _check_epoch(self) -> None:
        """Read (or create) the index epoch; a changed one means Redis restarted empty: resync every worker."""
        epoch = await redis_index.index_epoch(self._redis)
        if self._epoch is not None and epoch != self._epoch:
            lost = self.sequencer.resync_all()
            log.warning("redis lost the index; rebuilding from worker snapshots", workers=lost)
        self._epoch = epoch

    async def _retry(self) -> None:
        """Periodic: while Redis answers, check its epoch, redo failed clears and (re-)request due snapshots."""
        try:
            await self._check_epoch()
        except REDIS_ERRORS:
            return
        for worker_id in sorted(self._pending_clears):
            if not await self._clear(worker_id):
                return
        for worker_id, addr in self.sequencer.due_snapshot_requests(time.monotonic(),
                                                                    self.config.retry_interval_s):
            log.info("requesting snapshot (retry)", worker_id=worker_id)
            await self._request_snapshot(worker_id, addr)
