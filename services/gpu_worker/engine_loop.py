"""The engine's own thread: it takes commands from the event loop, steps the engine while there is work,
and hands every message that results back as Envelopes, in order (no sockets here).

    event loop ──submit(AddCommand | AbortCommand | SnapshotCommand | StopCommand)──▶ queue
    engine thread: drain queue → handle commands → engine.step() → deliver([Envelope, ...])

The thread blocks on the queue when the engine is idle, so an idle worker costs no CPU.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import structlog

from services.gpu_worker.engine import Engine
from services.gpu_worker.handoff import HandoffSettings, Handoffs, ImportDoneCommand
from services.gpu_worker.kv_transfer.base import default_host_id
from services.gpu_worker.request import TokenLogprob, TokenOutput
from shared.messages import (CacheSnapshot, EngineMetrics, GenerateError, HandoffAccepted, KVEventBatch, KVReady,
                             PrefillRequest, ReleaseLease, RequestFinished, TokenBatch, TokenizedRequest,
                             TokenLogprobEntry, TokenOutputs, TransferStats, WorkerLoad)
from shared.sampling import SamplingError

log = structlog.get_logger(__name__)


class Envelope(NamedTuple):
    """One outgoing message: addr is a PUSH address, or None for every scheduler."""

    addr: str | None
    msg: msgspec.Struct


@dataclass(frozen=True)
class AddCommand:
    request: TokenizedRequest


@dataclass(frozen=True)
class AbortCommand:
    request_id: str


@dataclass(frozen=True)
class SnapshotCommand:
    reply_addr: str


@dataclass(frozen=True)
class StopCommand:
    """Fail every in-flight request with `status` and end the thread."""

    status: int = 503
    message: str = "the worker is shutting down"


@dataclass(frozen=True)
class PrefillCommand:
    """PD prefill side: compute the prompt, stream the first token, lease the pages to the decode worker."""

    prefill: PrefillRequest


@dataclass(frozen=True)
class KVReadyCommand:
    """PD decode side: a prefill worker announced a request's pages."""

    ready: KVReady


@dataclass(frozen=True)
class ReleaseCommand:
    release: ReleaseLease


Command = (AddCommand | AbortCommand | SnapshotCommand | StopCommand | PrefillCommand | KVReadyCommand
           | ReleaseCommand | ImportDoneCommand)


@dataclass(frozen=True)
class WorkerIdentity:
    worker_id: str
    worker_addr: str
    incarnation: str  # random per start-up: tells cache_index that earlier event numbers are void
    cache_index_addr: str  # "" → KV events are numbered and dropped


@dataclass
class InFlight:
    """A request the engine holds: where its tokens go and which of its samples have ended."""

    reply_addr: str
    num_samples: int
    num_prompt_tokens: int
    finished_indices: set[int] = field(default_factory=set)
    prefill: PrefillRequest | None = None  # PD prefill side: where the KV goes after the first token


def token_outputs(out: TokenOutput) -> TokenOutputs:
    """One engine TokenOutput as its wire form."""
    logprobs = None if out.logprobs is None else [_logprob_entry(lp) for lp in out.logprobs]
    prompt_logprobs = None if out.prompt_logprobs is None else [
        None if lp is None else _logprob_entry(lp) for lp in out.prompt_logprobs]
    reason = None if out.finish_reason is None else out.finish_reason.value
    return TokenOutputs(out.request_id, out.index, [int(t) for t in out.token_ids], logprobs, reason,
                        out.num_prompt_tokens, out.num_cached_tokens, prompt_logprobs)


def _logprob_entry(lp: TokenLogprob) -> TokenLogprobEntry:
    return TokenLogprobEntry(int(lp.token_id), float(lp.logprob), [(int(t), float(v)) for t, v in lp.top],
                             None if lp.rank is None else int(lp.rank))


def engine_load(engine: Engine, num_leased_pages: int = 0) -> WorkerLoad:
    """The engine's load as heartbeats report it; num_free_pages counts only unused pool pages."""
    stats = engine.stats()
    num_queued = sum(s.num_uncomputed for s in engine.policy.waiting)
    num_queued += sum(s.num_uncomputed for s in engine.policy.running if s.num_uncomputed > 1)
    return WorkerLoad(num_running=stats.num_running, num_waiting=stats.num_waiting, num_queued_tokens=num_queued,
                      num_free_pages=stats.num_free_pages, num_total_pages=stats.num_total_pages,
                      num_cached_pages=stats.num_cached_pages, num_leased_pages=num_leased_pages,
                      max_num_seqs=engine.policy.max_num_seqs)


def engine_metrics(engine: Engine) -> EngineMetrics:
    """The engine's gauges now and a copy of its counters, as heartbeats report them (vLLM's meanings: cached pages
    that no request holds are evictable, so they count as free in num_request_pages)."""
    recorder, policy, cache = engine.metrics, engine.policy, engine.cache
    num_total = engine.pool.capacity
    num_request_pages = min(max(num_total - engine.pool.num_free - cache.num_evictable_pages, 0), num_total)
    return EngineMetrics(
        num_requests_running=len(policy.running), num_requests_waiting=len(policy.waiting),
        num_total_pages=num_total, num_request_pages=num_request_pages, num_cached_pages=cache.num_cached_pages,
        num_preemptions=policy.num_preemptions, num_prefix_queries=recorder.num_prefix_queries,
        num_prefix_hits=recorder.num_prefix_hits, num_prompt_tokens=recorder.num_prompt_tokens,
        num_generation_tokens=recorder.num_generation_tokens, queue_time_s=recorder.queue_time_s.as_wire(),
        step_time_s=recorder.step_time_s.as_wire(), step_tokens=recorder.step_tokens.as_wire(),
        step_sequences=recorder.step_sequences.as_wire(), num_spec_drafts=recorder.num_spec_drafts,
        num_spec_draft_tokens=recorder.num_spec_draft_tokens,
        num_spec_accepted_tokens=recorder.num_spec_accepted_tokens)


class EngineLoop:
    """Owns the engine from start() on: only the engine thread touches it."""

    def __init__(self, engine: Engine, identity: WorkerIdentity, deliver: Callable[[list[Envelope]], None],
                 clock: Callable[[], float] = time.time, handoff: HandoffSettings | None = None) -> None:
        self.engine = engine
        self.identity = identity
        self.next_seq = 0  # the number of the next KV event
        self.load = engine_load(engine)  # replaced (never mutated) by the engine thread
        self.metrics = engine_metrics(engine)  # likewise
        self._deliver = deliver
        self._clock = clock
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._in_flight: dict[str, InFlight] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.handoffs = Handoffs(engine, handoff or HandoffSettings(identity.worker_id, identity.worker_addr,
                                                                    default_host_id()), self.submit, clock)
        self.transfer: TransferStats = self.handoffs.stats  # replaced (never mutated) by the engine thread

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> None:
        """Thread-safe: queue a command for the engine thread."""
        self._commands.put(command)

    def stop(self, timeout_s: float) -> bool:
        """Fail what is in flight, end the thread; False if it did not end within timeout_s."""
        self.submit(StopCommand())
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def is_busy(self) -> bool:
        return bool(self._in_flight) and self.engine.has_unfinished()

    def _run(self) -> None:
        while True:
            envelopes: list[Envelope] = []
            for command in self._next_commands():
                if isinstance(command, StopCommand):
                    envelopes += self._fail_all(command.status, "server_error", command.message)
                    self.handoffs.close()
                    self._finish_iteration(envelopes)
                    return
                envelopes += self._handle(command)
            if self.is_busy:
                envelopes += self._step()
                envelopes += [Envelope(*e) for e in self.handoffs.after_step(self._take_prefill)]
            self.handoffs.expire()
            self._finish_iteration(envelopes)

    def _next_commands(self) -> list[Command]:
        """Every queued command; waits for one when the engine has nothing to do."""
        commands: list[Command] = []
        if not self.is_busy:
            try:
                commands.append(self._commands.get(timeout=self.handoffs.wait_timeout_s()))
            except queue.Empty:  # a lease is due to expire
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _finish_iteration(self, envelopes: list[Envelope]) -> None:
        envelopes += self._kv_events()
        self.load = engine_load(self.engine, self.handoffs.leases.num_pages)
        self.metrics = engine_metrics(self.engine)
        self.transfer = self.handoffs.stats
        if envelopes:
            self._deliver(envelopes)

    def _handle(self, command: Command) -> list[Envelope]:
        try:
            if isinstance(command, AddCommand):
                return self._add(command.request)
            if isinstance(command, AbortCommand):
                return self._abort(command.request_id)
            if isinstance(command, SnapshotCommand):
                return self._snapshot(command.reply_addr)
            if isinstance(command, PrefillCommand):  # a worker that exports no pool runs the request whole
                prefill = command.prefill if self.handoffs.settings.source is not None else None
                return self._add(command.prefill.request, prefill)
            if isinstance(command, KVReadyCommand):
                return self._import(command.ready)
            if isinstance(command, ImportDoneCommand):
                return [Envelope(*e) for e in self.handoffs.finish_import(command)]
            if isinstance(command, ReleaseCommand):
                self.handoffs.on_release(command.release)
                return []
        except Exception:  # noqa: BLE001 - an engine bug fails the work in flight, not the worker
            log.exception("engine command failed", command=type(command).__name__)
            envelopes = self._fail_all(500, "server_error", "the worker's engine failed")
            if isinstance(command, (AddCommand, PrefillCommand, KVReadyCommand)):
                request = (command.request if isinstance(command, AddCommand) else
                           command.prefill.request if isinstance(command, PrefillCommand) else command.ready.request)
                envelopes += self._reject(request, 500, "server_error", "the worker's engine failed")
            return envelopes
        return []

    def _add(self, request: TokenizedRequest, prefill: PrefillRequest | None = None) -> list[Envelope]:
        if request.deadline_s is not None and self._clock() > request.deadline_s:
            return self._reject(request, 504, "timeout", "the request's deadline passed before it started")
        try:
            params = request.sampling.check()
            self.engine.add_request(request.request_id, request.prompt_token_ids, params,
                                    is_prefill_only=prefill is not None, arrival_s=request.arrival_s)
        except ValueError as exc:
            return self._reject(request, 400, "invalid_request_error", str(exc), exc)
        self._in_flight[request.request_id] = InFlight(request.reply_addr, params.n,
                                                       len(request.prompt_token_ids), prefill=prefill)
        return []

    def _take_prefill(self, request_id: str) -> PrefillRequest | None:
        """A prefill-only request handed off: it leaves this worker's in-flight table."""
        state = self._in_flight.pop(request_id, None)
        return None if state is None else state.prefill

    def _import(self, ready: KVReady) -> list[Envelope]:
        """PD decode side: continue a request another worker prefilled (see handoff.py)."""
        request = ready.request
        if self.handoffs.was_aborted(request.request_id) or request.request_id in self._in_flight:
            return [Envelope(*self.handoffs.release_lease_of(ready))]
        try:
            params = request.sampling.check()
            envelopes = [Envelope(*e) for e in self.handoffs.start_import(ready, params)]
        except ValueError as exc:
            return [Envelope(*self.handoffs.release_lease_of(ready)),
                    *self._reject(request, 400, "invalid_request_error", str(exc), exc)]
        self._in_flight[request.request_id] = InFlight(request.reply_addr, 1, len(request.prompt_token_ids))
        return [Envelope(None, HandoffAccepted(request.request_id, self.identity.worker_id)), *envelopes]

    def _reject(self, request: TokenizedRequest, status: int, code: str, message: str,
                exc: Exception | None = None) -> list[Envelope]:
        """exc: a SamplingError lends the answer its OpenAI error code and param (e.g. context_length_exceeded)."""
        log.info("request rejected", request_id=request.request_id, status=status, reason=message)
        error_code, param = (exc.code, exc.param) if isinstance(exc, SamplingError) else (None, None)
        envelopes = [Envelope(request.reply_addr, GenerateError(request.request_id, status, code, message,
                                                                error_code=error_code, param=param))]
        if request.request_id not in self._in_flight:  # NOTE: a duplicate id must not end the original
            envelopes.append(self._finished(request.request_id))
        return envelopes

    def _abort(self, request_id: str) -> list[Envelope]:
        """Abort a request; every sample not yet ended ends with "abort" (unforked siblings included)."""
        self.handoffs.on_abort(request_id)
        state = self._in_flight.get(request_id)
        if state is None:
            return []
        outputs = [token_outputs(out) for out in self.engine.abort(request_id)]
        reported = state.finished_indices | {out.index for out in outputs}
        outputs += [TokenOutputs(request_id, index, [], None, "abort", state.num_prompt_tokens, 0)
                    for index in range(state.num_samples) if index not in reported]
        return self._route(outputs)

    def _step(self) -> list[Envelope]:
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001 - a bug or OOM fails the requests in flight; the worker serves on
            log.exception("engine step failed; failing every request in flight", num_requests=len(self._in_flight))
            return self._fail_all(500, "server_error", "the worker's engine failed")
        return self._route([token_outputs(out) for out in outputs])

    def _route(self, outputs: list[TokenOutputs]) -> list[Envelope]:
        """One TokenBatch per reply address, then RequestFinished for requests whose samples all ended."""
        batches: dict[str, list[TokenOutputs]] = {}
        done: list[str] = []
        for out in outputs:
            state = self._in_flight.get(out.request_id)
            if state is None:
                continue
            batches.setdefault(state.reply_addr, []).append(out)
            if out.finish_reason is not None:
                state.finished_indices.add(out.index)
                if len(state.finished_indices) == state.num_samples:
                    done.append(out.request_id)
        envelopes = [Envelope(addr, TokenBatch(self.identity.worker_id, outs)) for addr, outs in batches.items()]
        for request_id in done:
            self.engine.release_finished(request_id)
            del self._in_flight[request_id]
            envelopes.append(self._finished(request_id))
        return envelopes

    def _fail_all(self, status: int, code: str, message: str) -> list[Envelope]:
        """End every in-flight request with GenerateError(status) and abort it in the engine."""
        envelopes: list[Envelope] = []
        for request_id, state in self._in_flight.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - keep resetting the others
                log.exception("abort failed", request_id=request_id)
            envelopes.append(Envelope(state.reply_addr, GenerateError(request_id, status, code, message)))
            envelopes.append(self._finished(request_id))
        self._in_flight.clear()
        self.handoffs.release_all()
        return envelopes

    def _finished(self, request_id: str) -> Envelope:
        return Envelope(None, RequestFinished(request_id, self.identity.worker_id))

    def _kv_events(self) -> list[Envelope]:
        """The radix cache's new events, numbered on from next_seq (dropped when no cache_index listens)."""
        events = self.engine.cache.drain_events()
        if not events:
            return []
        first_seq, self.next_seq = self.next_seq, self.next_seq + len(events)
        if not self.identity.cache_index_addr:
            return []
        ident = self.identity
        return [Envelope(ident.cache_index_addr,
                         KVEventBatch(ident.worker_id, ident.worker_addr, ident.incarnation, first_seq, events))]

    def _snapshot(self, reply_addr: str) -> list[Envelope]:
        """Events still pending go out first, so the snapshot is exact as of its next_seq."""
        envelopes = self._kv_events()
        snapshot = CacheSnapshot(self.identity.worker_id, self.identity.incarnation, self.next_seq,
                                 list(self.engine.cache.cached_blocks()))
        return envelopes + [Envelope(reply_addr, snapshot)]
