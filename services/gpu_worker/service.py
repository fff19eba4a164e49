"""The gpu_worker actor shell: sockets, the message table, heartbeats and shutdown around the engine thread."""
from __future__ import annotations

import asyncio
import gc
import os
import time
import uuid

import msgspec
import structlog
import zmq
import zmq.asyncio

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_loop import (AbortCommand, AddCommand, EngineLoop, Envelope, KVReadyCommand,
                                             PrefillCommand, ReleaseCommand, SnapshotCommand, WorkerIdentity)
from services.gpu_worker.handoff import HandoffSettings
from services.gpu_worker.kv_transfer.export import ExportedPool, export_pool
from services.gpu_worker.kv_transfer.stream import PageServer
from services.gpu_worker.parallel.tp_engine import LockstepEngine, start_engine
from shared import hashing, transport
from shared.actor import Actor
from shared.logging import write_line
from shared.messages import (AbortRequest, KVReady, PrefillRequest, ReleaseLease, SnapshotRequest,
                             TokenizedRequest, WorkerGone, WorkerHeartbeat, WorkerInbound, WorkerLoad)

log = structlog.get_logger(__name__)

LOAD_PROGRESS_INTERVAL_S = 2.0
STOP_TIMEOUT_S = 10.0
FLUSH_LINGER_MS = 1000  # how long final messages may take to leave at shutdown


class WorkerService(Actor):
    name = "gpu_worker"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__()
        self.config = config
        self.worker_id = config.resolved_worker_id
        self.incarnation = uuid.uuid4().hex
        self.engine_loop: EngineLoop | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._dealers: list[zmq.asyncio.Socket] = []
        self._stalled_dealers: set[int] = set()  # indexes of schedulers whose queue was full at the last send
        self._num_dropped = 0  # messages to schedulers given up (PushPool counts its own)
        self._pushes = transport.PushPool()
        self._outbox: asyncio.Queue[list[Envelope]] = asyncio.Queue()
        self._worker_addr = config.worker_addr
        self._page_server: PageServer | None = None
        self._exported: ExportedPool | None = None
        self._tp_engine: LockstepEngine | None = None  # tensor_parallel_size > 1: rank 0, its followers spawned
        self._is_draining = False
        self._handlers = {TokenizedRequest: self._on_request, AbortRequest: self._on_abort,
                          SnapshotRequest: self._on_snapshot, PrefillRequest: self._on_prefill,
                          KVReady: self._on_kv_ready, ReleaseLease: self._on_release}

    async def start(self) -> None:
        hashing.self_check()
        self._pull = transport.bind(zmq.PULL, self.config.worker_addr)
        self._worker_addr = transport.advertised(transport.bound_addr(self._pull))
        engine = await self._load_engine()
        # NOTE: what start-up made (torch, transformers, the model: ~200k objects) lives until exit: frozen, it is
        # skipped by every collection, the interpreter's last ones at exit included (they took ~1 s of CPU after
        # SIGTERM, 4-5 s on a loaded machine). Collected first, so no garbage of the load is kept for good.
        gc.collect()
        gc.freeze()
        identity = WorkerIdentity(self.worker_id, self._worker_addr, self.incarnation, self.config.cache_index_addr)
        self.engine_loop = EngineLoop(engine, identity, self._deliver_threadsafe(asyncio.get_running_loop()),
                                      handoff=self._handoff_settings(engine))
        if self._page_server is not None:
            self.spawn(self._page_server.serve_forever(), "pages")
        self._dealers = [transport.connect(zmq.DEALER, addr, identity=self.worker_id.encode())
                         for addr in self.config.scheduler_addr_list]
        self.engine_loop.start()
        self.spawn(self._send_forever(), "send")
        self.spawn(transport.receive_forever(self._pull, WorkerInbound, self._dispatch), "receive")
        await self._heartbeat()
        self.every(self.config.heartbeat_interval_s, self._heartbeat, "heartbeat")
        log.info("ready", worker_id=self.worker_id, addr=self._worker_addr, model_id=engine.model_config.model_id,
                 device=str(engine.device), weights=engine.weights, num_pages=engine.num_pages,
                 allocator_idle_gib=round(engine.allocator_idle_bytes / 2**30, 2),
                 incarnation=self.incarnation,
                 max_num_batched_tokens=engine.policy.max_num_batched_tokens,
                 max_num_seqs=engine.policy.max_num_seqs, batching=engine.batching.reason,
                 cuda_graph_buckets=_buckets(engine.graphs), verify_graph_buckets=_buckets(engine.verify_graphs))

    async def _load_engine(self) -> Engine | LockstepEngine:
        """Build the engine in a thread, printing a progress line on stderr until it is ready.

        With tensor_parallel_size > 1 this process is rank 0 (a LockstepEngine), ranks 1..N-1 are spawned.
        """
        started = time.monotonic()

        async def progress() -> None:
            while True:
                write_line(f"gpu_worker {self.worker_id}: loading {self.config.model} "
                           f"({time.monotonic() - started:.0f}s)")
                await asyncio.sleep(LOAD_PROGRESS_INTERVAL_S)

        reporter = asyncio.ensure_future(progress())
        try:
            engine = await asyncio.to_thread(start_engine, self.config.engine_config())
        finally:
            reporter.cancel()
        write_line(f"gpu_worker {self.worker_id}: model loaded in {time.monotonic() - started:.1f}s")
        if isinstance(engine, LockstepEngine):
            self._tp_engine = engine
        return engine

    def _handoff_settings(self, engine: Engine) -> HandoffSettings:
        """PD: a prefill worker shares its KV pool (shm or CUDA IPC by device) and serves pages as a stream."""
        config = self.config
        source = None
        if config.role == "prefill":
            self._page_server = PageServer(config.transfer_addr, self._is_leased, engine.export_pages)
            shm_name = f"radixserve-kv-{self.worker_id}-{self.incarnation[:12]}"
            self._exported = export_pool(engine.kv, config.resolved_host_id, shm_name, self._page_server.addr,
                                         config.kv_transfer)
            source = self._exported.source
            log.info("kv pool exported", shm_name=source.shm_name or None, stream_addr=source.stream_addr,
                     has_cuda_ipc=source.cuda_k is not None)
        return HandoffSettings(self.worker_id, self._worker_addr, config.resolved_host_id, config.lease_ttl_s,
                               config.kv_transfer, config.num_pull_threads, source)

    def _is_leased(self, lease_id: str, page_ids: list[int]) -> bool:
        return self.engine_loop is not None and self.engine_loop.handoffs.is_leased(lease_id, page_ids)

    def _deliver_threadsafe(self, loop: asyncio.AbstractEventLoop):
        """The engine thread's delivery callback: hand envelopes to the event loop's outbox."""
        def deliver(envelopes: list[Envelope]) -> None:
            try:
                loop.call_soon_threadsafe(self._outbox.put_nowait, envelopes)
            except RuntimeError:  # the loop closed during shutdown
                log.warning("dropped messages after the event loop closed", num_messages=len(envelopes))
        return deliver

    async def _dispatch(self, msg: msgspec.Struct, identity: bytes | None) -> None:
        await self._handlers[type(msg)](msg)

    async def _on_request(self, msg: TokenizedRequest) -> None:
        self.engine_loop.submit(AddCommand(msg))

    async def _on_abort(self, msg: AbortRequest) -> None:
        self.engine_loop.submit(AbortCommand(msg.request_id))

    async def _on_snapshot(self, msg: SnapshotRequest) -> None:
        self.engine_loop.submit(SnapshotCommand(msg.reply_addr))

    async def _on_prefill(self, msg: PrefillRequest) -> None:
        self.engine_loop.submit(PrefillCommand(msg))

    async def _on_kv_ready(self, msg: KVReady) -> None:
        self.engine_loop.submit(KVReadyCommand(msg))

    async def _on_release(self, msg: ReleaseLease) -> None:
        self.engine_loop.submit(ReleaseCommand(msg))

    async def _send_forever(self) -> None:
        while True:
            await self._send_all(await self._outbox.get())

    async def _send_all(self, envelopes: list[Envelope]) -> None:
        for addr, msg in envelopes:
            if addr is None:
                await self._to_schedulers(msg)
            else:
                await self._pushes.send(addr, msg)

    async def _to_schedulers(self, msg: msgspec.Struct) -> None:
        """NOTE: a scheduler whose queue is full (it reads nothing) holds the send path MAX_SEND_WAIT_S once, then
        its messages are dropped without waiting until one fits again: never the send path for good."""
        for index, dealer in enumerate(self._dealers):
            is_stalled = index in self._stalled_dealers
            dropped = await transport.send(dealer, msg, max_wait_s=0.0 if is_stalled else transport.MAX_SEND_WAIT_S)
            if dropped is None:
                self._stalled_dealers.discard(index)
                continue
            self._num_dropped += 1
            if not is_stalled:
                self._stalled_dealers.add(index)
                log.warning("a scheduler reads nothing: dropping its messages until it does",
                            scheduler_addr=self.config.scheduler_addr_list[index], message=type(msg).__name__,
                            num_dropped=self._num_dropped + sum(self._pushes.num_dropped.values()))

    async def _heartbeat(self) -> None:
        engine = self.engine_loop.engine
        await self._to_schedulers(WorkerHeartbeat(
            worker_id=self.worker_id, incarnation=self.incarnation, addr=self._worker_addr,
            model_id=engine.model_config.model_id, role=self.config.role, page_size=engine.config.page_size,
            load=self.engine_loop.load, transfer=self.engine_loop.transfer, metrics=self.engine_loop.metrics,
            is_draining=self._is_draining))
        if self.config.health_file:
            write_health_file(self.config.health_file, "draining" if self._is_draining else "serving")

    async def drain(self) -> None:
        """Say draining (schedulers route nothing new here), let requests routed meanwhile arrive, then serve what
        is held until the engine is idle or drain_timeout_s passed; close() fails whatever is left."""
        if self.engine_loop is None or not self.config.drain_timeout_s:
            return
        self._is_draining = True
        await self._heartbeat()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        await asyncio.sleep(min(2 * self.config.heartbeat_interval_s, self.config.drain_timeout_s))
        log.info("draining", load=msgspec.structs.asdict(self.engine_loop.load),
                 timeout_s=self.config.drain_timeout_s)
        while not is_idle(self.engine_loop.load) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not is_idle(self.engine_loop.load):
            log.warning("drain timeout; failing the requests left", load=msgspec.structs.asdict(self.engine_loop.load))

    async def close(self) -> None:
        """Fail what is in flight, flush its messages, say WorkerGone, and close every socket."""
        is_engine_idle = True
        if self.engine_loop is not None:
            if not await asyncio.to_thread(self.engine_loop.stop, STOP_TIMEOUT_S):
                is_engine_idle = False
                log.error("engine thread did not stop in time", timeout_s=STOP_TIMEOUT_S)
            await asyncio.sleep(0)  # run the engine thread's last call_soon_threadsafe deliveries
            while not self._outbox.empty():
                await self._send_all(self._outbox.get_nowait())
            gone = WorkerGone(self.worker_id)
            await self._to_schedulers(gone)
            if self.config.cache_index_addr:
                await self._pushes.send(self.config.cache_index_addr, gone)
        if self._tp_engine is not None:  # NOTE: only once the engine thread is out of its step (one caller)
            if not is_engine_idle or not await asyncio.to_thread(self._tp_engine.shutdown):
                log.error("tensor-parallel followers did not stop cleanly")  # they are daemons: they end with us
        if self._page_server is not None:
            self._page_server.close()
        if self._exported is not None:
            self._exported.close()
        # NOTE: destroy() closes every socket of the context (PushPool's too) with this linger, then blocks
        # until the final messages left or the linger ran out.
        transport.context().destroy(linger=FLUSH_LINGER_MS)


def is_idle(load: WorkerLoad) -> bool:
    """Nothing running, waiting or leased to a decode worker."""
    return load.num_running == 0 and load.num_waiting == 0 and load.num_leased_pages == 0


def write_health_file(path: str, state: str) -> None:
    """Replace path's content with state (atomically: a probe never reads half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(state)
    os.replace(tmp, path)


def _buckets(graphs: object) -> list[int] | None:
    """The batch sizes a captured graph set (cuda_graphs.py) replays, for the ready log; None when none was built."""
    return None if graphs is None else list(graphs.buckets)
