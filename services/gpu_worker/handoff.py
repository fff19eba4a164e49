"""PD handoff inside one worker's engine thread: leases on the prefill side, imports and pulls on the decode side.

    prefill worker                                   decode worker
    PrefillRequest → engine (prefill-only) → first token → TokenBatch to the tokenizer (TTFT)
                  → lease(page ids) → KVReady ──────▶ import_request: match own cache, allocate the rest
                                                      pull thread: copy the missing pages (shm/cuda_ipc/stream)
    free the pages ◀──────── ReleaseLease ─────────── finish_import: join the decode batch (or recompute)

A lease also ends on abort or expiry; a failed or late pull makes the decode side recompute the prompt
itself (the first token is already out, so it continues after it). No sockets here: outgoing messages
are Envelopes, and the pull threads report back through `submit`.
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.gpu_worker.engine import Engine, Handoff
from services.gpu_worker.kv_transfer import KVPuller, TransferError, make_puller, select_backend
from services.gpu_worker.lease_table import Lease, LeaseTable
from shared.messages import (KVReady, KVSource, PrefillRequest, ReleaseLease, RequestFinished, TokenLogprobEntry,
                             TransferStats)

log = structlog.get_logger(__name__)

LEASE_MARGIN_S = 0.5  # a pull does not start this close to its lease's end (it recomputes instead)
MAX_REMEMBERED_ABORTS = 4096


@dataclass(frozen=True)
class ImportDoneCommand:
    """A pull thread finished (is_filled) or failed; the engine thread joins or recomputes the request."""

    request_id: str
    is_filled: bool
    num_pages: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class HandoffSettings:
    worker_id: str
    worker_addr: str
    host_id: str
    lease_ttl_s: float = 30.0
    kv_transfer: str = "auto"  # auto | shm | cuda_ipc | stream
    num_pull_threads: int = 2
    source: KVSource | None = None  # set on workers that export their pool (prefill role)


@dataclass
class _Counters:
    values: dict[str, Any] = field(default_factory=lambda: {f: 0 for f in TransferStats.__struct_fields__})

    def add(self, name: str, amount: float = 1) -> None:
        self.values[name] += amount


class Handoffs:
    """Only the engine thread calls these methods (except `is_leased`, read by the page server)."""

    def __init__(self, engine: Engine, settings: HandoffSettings, submit: Callable[[Any], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.settings = settings
        self.leases = LeaseTable()
        self._submit = submit
        self._clock = clock
        self._counters = _Counters()
        self._pulls: ThreadPoolExecutor | None = None
        self._pullers: dict[str, KVPuller] = {}
        self._pullers_lock = threading.Lock()
        self._importing: dict[str, KVReady] = {}
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def stats(self) -> TransferStats:
        return TransferStats(**{**self._counters.values, "num_leases": len(self.leases)})

    # --- prefill side ----------------------------------------------------------------------------------

    def after_step(self, take_in_flight: Callable[[str], PrefillRequest | None]) -> list[tuple[str | None, Any]]:
        """Lease the pages of every request that just sampled its first token and announce them."""
        envelopes: list[tuple[str | None, Any]] = []
        for handoff in self.engine.drain_handoffs():
            prefill = take_in_flight(handoff.request_id)
            if prefill is None or self.settings.source is None:
                self.engine.release_held(handoff.request_id)
                continue
            envelopes += self._announce(prefill, handoff)
        return envelopes

    def _announce(self, prefill: PrefillRequest, handoff: Handoff) -> list[tuple[str | None, Any]]:
        lease = Lease(uuid.uuid4().hex, handoff.request_id, tuple(handoff.page_ids),
                      self._clock() + self.settings.lease_ttl_s, prefill.decode_worker_id)
        self.leases.grant(lease)
        self._counters.add("num_handoffs")
        lp = handoff.first_logprob
        first_logprob = None if lp is None else TokenLogprobEntry(
            int(lp.token_id), float(lp.logprob), [(int(t), float(v)) for t, v in lp.top])
        ready = KVReady(prefill.request, handoff.first_token, first_logprob, handoff.num_cached_tokens,
                        list(handoff.page_ids), self.settings.source, self.settings.worker_id,
                        self.settings.worker_addr, lease.lease_id, lease.expires_s)
        return [(prefill.decode_addr, ready),
                (None, RequestFinished(handoff.request_id, self.settings.worker_id, handed_off=True))]

    def on_release(self, msg: ReleaseLease) -> None:
        lease = self.leases.release(msg.lease_id)
        if lease is not None:
            self.engine.release_held(lease.request_id)

    def on_abort(self, request_id: str) -> bool:
        """End the request's lease, if it has one (the decode side was told to abort too)."""
        lease = self.leases.release_request(request_id)
        if lease is not None:
            self.engine.release_held(request_id)
        if len(self._aborted) >= MAX_REMEMBERED_ABORTS:
            self._aborted.popitem(last=False)
        self._aborted[request_id] = None
        return lease is not None

    def expire(self) -> None:
        for lease in self.leases.expire(self._clock()):
            log.warning("lease expired; pages freed", request_id=lease.request_id, lease_id=lease.lease_id,
                        decode_worker_id=lease.decode_worker_id, num_pages=len(lease.page_ids))
            self._counters.add("num_leases_expired")
            self.engine.release_held(lease.request_id)

    def release_all(self) -> None:
        for lease in self.leases.expire(float("inf")):
            self.engine.release_held(lease.request_id)

    def wait_timeout_s(self) -> float | None:
        """How long the idle engine thread may block before a lease needs expiring (None: forever)."""
        next_s = self.leases.next_expiry_s()
        return None if next_s is None else max(0.0, next_s - self._clock()) + 0.01

    def is_leased(self, lease_id: str, page_ids: list[int]) -> bool:
        """Thread-safe enough for the page server: a dict read of an immutable Lease."""
        lease = self.leases.get(lease_id)
        return lease is not None and self._clock() < lease.expires_s and set(page_ids) <= set(lease.page_ids)

    # --- decode side -----------------------------------------------------------------------------------

    def was_aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def start_import(self, ready: KVReady, params: Any) -> list[tuple[str | None, Any]]:
        """Take a prefilled request: reuse own cached pages, pull the rest in a thread (or recompute)."""
        request = ready.request
        plan = self.engine.import_request(request.request_id, request.prompt_token_ids, ready.first_token, params,
                                          ready.num_cached_tokens)
        if plan.is_recompute:
            self._counters.add("num_import_fallbacks")
            return [self._release(ready, 0)]
        indices = plan.page_indices_to_fill
        src = [ready.page_ids[i] for i in indices]
        dst = [plan.page_ids[i] for i in indices]
        self._counters.add("num_pages_reused", plan.num_reused_pages)
        if not src:
            self.engine.finish_import(request.request_id, is_filled=True)
            self._counters.add("num_imports")
            return [self._release(ready, 0)]
        self._importing[request.request_id] = ready
        if self._pulls is None:
            self._pulls = ThreadPoolExecutor(self.settings.num_pull_threads, thread_name_prefix="kv-pull")
        self._pulls.submit(self._pull, ready, src, dst)
        return []

    def _pull(self, ready: KVReady, src: list[int], dst: list[int]) -> None:
        """In a pull thread: copy pages, then hand the result to the engine thread."""
        started = time.monotonic()
        num_bytes, is_filled = 0, False
        try:
            if self._clock() > ready.lease_expires_s - LEASE_MARGIN_S:
                raise TransferError("the lease ends before a pull could finish")
            backend = select_backend(ready.source, self.settings.host_id, self.engine.device.type,
                                     self.settings.kv_transfer)
            num_bytes = self._puller(backend).pull(ready.source, ready.lease_id, src, dst, self.engine.kv)
            if self._clock() >= ready.lease_expires_s:  # NOTE: the source may have reused the pages meanwhile
                raise TransferError("the lease expired during the pull")
            is_filled = True
        except Exception as exc:  # noqa: BLE001 - any failure means: recompute locally
            log.warning("kv pull failed; recomputing the prompt here", request_id=ready.request.request_id,
                        prefill_worker_id=ready.prefill_worker_id, error=repr(exc))
        self._submit(ImportDoneCommand(ready.request.request_id, is_filled, len(src), num_bytes,
                                       time.monotonic() - started))

    def _puller(self, backend: str) -> KVPuller:
        with self._pullers_lock:
            puller = self._pullers.get(backend)
            if puller is None:
                puller = self._pullers[backend] = make_puller(backend)
            return puller

    def finish_import(self, done: ImportDoneCommand) -> list[tuple[str | None, Any]]:
        ready = self._importing.pop(done.request_id)
        is_live = self.engine.finish_import(done.request_id, done.is_filled)
        if done.is_filled:
            self._counters.add("num_pages_pulled", done.num_pages)
            self._counters.add("num_bytes_pulled", done.num_bytes)
            self._counters.add("pull_seconds", done.seconds)
            if is_live:
                self._counters.add("num_imports")
        elif is_live:
            self._counters.add("num_import_fallbacks")
        return [self._release(ready, done.num_pages if done.is_filled else 0)]

    def release_lease_of(self, ready: KVReady) -> tuple[str, ReleaseLease]:
        return self._release(ready, 0)

    def _release(self, ready: KVReady, num_pages: int) -> tuple[str, ReleaseLease]:
        return ready.prefill_addr, ReleaseLease(ready.lease_id, ready.request.request_id, num_pages)

    def close(self) -> None:
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
