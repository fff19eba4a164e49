"""The scheduler actor shell: one ROUTER for tokenizers, workers and gateways; admission, routing through a
policy (global index lookups merged with pending entries), the in-flight table, failing the requests of
workers that die, taking over the requests of a dead scheduler replica, and the /metrics endpoint."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import Counter

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
import structlog
import zmq
import zmq.asyncio

from services.scheduler.adoption import Adoption, Handovers
from services.scheduler.config import SchedulerConfig
from services.scheduler.inflight import InFlight, InFlightTable
from services.scheduler.lookup_budget import LookupBudget
from services.scheduler.metrics import SchedulerMetrics, serve_metrics
from services.scheduler.pending import PendingPrefixes, merge_prefixes
from services.scheduler.pairing import LOCAL_ROLES, Pairing, make_pairing
from services.scheduler.policy import Candidate, Reason, RouteRequest, make_policy
from services.scheduler.registry import HeartbeatKind, Registry
from services.scheduler.waiting_queue import WaitingQueue, queue_deadline_s
from shared import redis_index, transport
from shared.actor import Actor
from shared.messages import (AbortRequest, AdoptRequest, EngineMetrics, GenerateError, HandoffAccepted, MetricsReply,
                             MetricsRequest, PrefillRequest, RequestFinished, RequestRouted, SchedulerInbound,
                             StatusReply, StatusRequest, TokenizedRequest, WorkerGone, WorkerHeartbeat)

log = structlog.get_logger(__name__)

REDIS_ERRORS = (redis.exceptions.RedisError, OSError, asyncio.TimeoutError)
MAX_TICK_S = 0.25
QUEUE_FULL_RETRY_AFTER_S = 1.0


class SchedulerService(Actor):
    name = "scheduler"

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__()
        self.config = config
        self.incarnation = uuid.uuid4().hex  # tells tokenizers that a restarted scheduler forgot its requests
        self.registry = Registry()
        self.inflight = InFlightTable()
        self.handovers = Handovers(config.abort_memory_s, config.heartbeat_timeout_s)
        self.queue = WaitingQueue(config.max_queue, config.max_queued_tokens)
        self.policy = make_policy(config.routing, config.heartbeat_timeout_s, config.cost_weights, LOCAL_ROLES)
        self.pairing = make_pairing(config.pd_policy, self.policy, config.heartbeat_timeout_s, config.cost_weights,
                                    config.pd_min_prefill_tokens)
        self.pending = PendingPrefixes(config.pending_ttl_s)
        self._engine_metrics: dict[str, EngineMetrics] = {}  # worker_id → its latest heartbeat's metrics
        self.metrics = SchedulerMetrics(config.routing, self._live_engine_metrics, self.loop_lag)
        self.metrics.gauge("radixserve_scheduler_workers", "live workers known", lambda: len(self.registry))
        self.metrics.gauge("radixserve_scheduler_queued_requests", "requests waiting for a worker",
                           lambda: len(self.queue))
        self.metrics.gauge("radixserve_scheduler_in_flight_requests", "requests routed and not finished",
                           lambda: len(self.inflight))
        self._metrics_runner = None
        self._router: zmq.asyncio.Socket | None = None
        self._pushes = transport.PushPool()
        self._num_reply_drops: Counter[transport.DropReason] = Counter()
        self.metrics.counters("radixserve_scheduler_dropped_messages",
                              "messages to peers given up: an invalid address, no socket, a peer that reads "
                              "nothing (its queue full), a peer not connected", "reason", self._dropped_messages)
        self._redis: aioredis.Redis | None = None
        self._lookup_budget = LookupBudget(config.redis_timeout_s, max(config.redis_timeout_s, config.redis_timeout_max_s),
                                           config.redis_retry_s)
        self._handlers = {TokenizedRequest: self._on_request, AbortRequest: self._on_abort,
                          WorkerHeartbeat: self._on_heartbeat, RequestFinished: self._on_finished,
                          WorkerGone: self._on_worker_gone, StatusRequest: self._on_status,
                          HandoffAccepted: self._on_handoff_accepted, AdoptRequest: self._on_adopt,
                          MetricsRequest: self._on_metrics}

    async def start(self) -> None:
        self._router = transport.bind(zmq.ROUTER, self.config.scheduler_addr)
        if self.config.redis_url:
            self._redis = aioredis.from_url(self.config.redis_url, socket_timeout=self._lookup_budget.max_s,
                                            socket_connect_timeout=self._lookup_budget.max_s)
        self.spawn(transport.receive_forever(self._router, SchedulerInbound, self._dispatch, has_identity=True),
                   "receive")
        self.every(min(MAX_TICK_S, self.config.heartbeat_timeout_s / 4), self._tick, "expiry")
        if self.config.metrics_port:
            self._metrics_runner = await serve_metrics(self.metrics, self.config.metrics_host,
                                                       self.config.metrics_port)
        log.info("ready", addr=transport.bound_addr(self._router), incarnation=self.incarnation,
                 routing=self.config.routing,
                 redis_url=self.config.redis_url or None, metrics_port=self.config.metrics_port or None)

    async def close(self) -> None:
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        self._pushes.close()
        if self._router is not None:
            self._router.close(linger=0)
        if self._redis is not None:
            await self._redis.aclose()

    async def _dispatch(self, msg: msgspec.Struct, identity: bytes | None) -> None:
        await self._handlers[type(msg)](msg, identity)

    async def _on_request(self, request: TokenizedRequest, identity: bytes | None) -> None:
        if not await self._route(request):
            await self._enqueue(request)

    async def _route(self, request: TokenizedRequest) -> bool:
        """Send request to the policy's worker and record it in flight; False if no worker may take it."""
        if not len(self.registry):
            return False
        pairing = await self._decide(request)
        if pairing is None:
            return False
        decode, prefill = pairing.decode, pairing.prefill
        self.inflight.add(request.request_id, decode.worker_id, request.reply_addr,
                          prefill.worker_id if prefill is not None else None)
        self.pending.add(request.block_hashes, decode.worker_id, time.monotonic())
        self.metrics.on_routed(prefill or decode, len(request.block_hashes))
        decode_addr = self.registry.get(decode.worker_id).addr
        if prefill is None:
            await self._pushes.send(decode_addr, request)
        else:
            self.pending.add(request.block_hashes, prefill.worker_id, time.monotonic())
            await self._pushes.send(self.registry.get(prefill.worker_id).addr,
                                    PrefillRequest(request, decode.worker_id, decode_addr))
        if request.wants_routed:
            await self._to_tokenizer(request.reply_addr, RequestRouted(
                request.request_id, decode.worker_id, prefill.worker_id if prefill is not None else ""))
        return True

    async def _decide(self, request: TokenizedRequest) -> Pairing | None:
        """The policy's choice over every known worker, given the prefix each holds; logged with its reason."""
        cached = await self._lookup_prefix(request)
        now_s = time.monotonic()
        if cached is not None:
            cached = merge_prefixes(cached, self.pending.longest_prefix(request.block_hashes, now_s))
        route = RouteRequest(request.request_id, len(request.prompt_token_ids), len(request.block_hashes),
                             now_s, model_id=request.model_id or None, num_cached_blocks=cached or {})
        candidates = [Candidate(w, self.inflight.count(w.worker_id)) for w in self.registry.workers()
                      if self.inflight.count(w.worker_id) < self.config.requests_per_worker(w.load.max_num_seqs)]
        pairing = self.pairing.choose(candidates, route, request.sampling.n)
        if pairing is not None and cached is None:
            pairing = dataclasses.replace(pairing, decode=dataclasses.replace(pairing.decode, reason=Reason.FALLBACK))
        if pairing is not None:
            log.debug("routed", request_id=request.request_id, worker_id=pairing.decode.worker_id,
                      prefill_worker_id=pairing.prefill.worker_id if pairing.prefill else None,
                      pd=pairing.reason.value, policy=self.config.routing, reason=pairing.decode.reason.value,
                      num_blocks=len(request.block_hashes), num_cached_blocks=route.num_cached_blocks)
        return pairing

    async def _lookup_prefix(self, request: TokenizedRequest) -> dict[str, int] | None:
        """{worker_id: cached prefix blocks} from the global index ({} without Redis or block hashes);
        None while the index cannot be read: the request is then routed on load alone."""
        now_s = time.monotonic()
        if self._redis is None or not request.block_hashes:
            return {}
        budget = self._lookup_budget
        if budget.is_paused(now_s):
            return None
        timeout_s = budget.timeout_s()
        try:
            cached = await asyncio.wait_for(redis_index.longest_prefix(self._redis, request.block_hashes), timeout_s)
        except REDIS_ERRORS as exc:
            self.metrics.lookup_errors.inc()
            was_failing = budget.paused_until_s > 0
            if isinstance(exc, asyncio.TimeoutError) and not budget.on_timeout(time.monotonic()):
                log.info("prefix lookup over its budget; this request routed on load alone", timeout_s=timeout_s)
                return None
            if not was_failing:
                log.warning("prefix lookup failed; routing on load alone", error=repr(exc))
            budget.on_error(now_s)
            return None
        latency_s = time.monotonic() - now_s
        self.metrics.lookup_seconds.observe(latency_s)
        if budget.on_success(latency_s):
            log.info("prefix lookups recovered")
        log.debug("prefix lookup", request_id=request.request_id, num_blocks=len(request.block_hashes),
                  num_cached_blocks=cached)
        return cached

    async def _enqueue(self, request: TokenizedRequest) -> None:
        deadline_s = queue_deadline_s(time.time(), self.config.max_queue_wait_s, request.deadline_s)
        if not self.queue.push(request, deadline_s):
            await self._fail(request.request_id, request.reply_addr, 429, "scheduler queue is full",
                             code="rate_limit_error", retry_after_s=QUEUE_FULL_RETRY_AFTER_S)

    async def _drain(self) -> None:
        """Route queued requests, oldest first, until one cannot be placed."""
        while (waiting := self.queue.pop()) is not None:
            if not await self._route(waiting.request):
                self.queue.push_front(waiting)
                return

    async def _on_abort(self, msg: AbortRequest, identity: bytes | None) -> None:
        """Stop the request's queued or routed copy here; with msg.worker_id, its run on that worker when this
        scheduler did not route it there (forwarded). A plain abort for a request unknown here is remembered a
        while, in case a tokenizer hands the request over from a dead scheduler."""
        is_queued = self.queue.remove(msg.request_id)
        entry = self.inflight.get(msg.request_id)
        if entry is not None and msg.worker_id in ("", entry.worker_id, entry.prefill_worker_id):
            self.inflight.pop(msg.request_id)
            await self._abort_legs(entry, msg)
        elif msg.worker_id:
            worker = self.registry.get(msg.worker_id)
            if worker is not None:
                await self._pushes.send(worker.addr, msg)
        elif not is_queued:
            self.handovers.note_abort(msg.request_id, time.monotonic())

    async def _on_adopt(self, msg: AdoptRequest, identity: bytes | None) -> None:
        """Take over the in-flight entry of a request whose scheduler died; its tokenizer says where it runs."""
        legs = [w for w in (msg.worker_id, msg.prefill_worker_id) if w]
        adoption = self.handovers.on_adopt(msg.request_id, legs, self.registry, time.monotonic())
        if adoption is Adoption.ENDED:
            return  # it ended on its worker before the handover arrived
        if adoption is Adoption.ABORTED:  # its abort came before it did
            log.info("adopted request was aborted; stopping it", request_id=msg.request_id, worker_id=msg.worker_id)
            await self._abort_legs(InFlight(msg.request_id, msg.worker_id, msg.reply_addr,
                                            msg.prefill_worker_id or None), AbortRequest(msg.request_id))
            return
        self.inflight.add(msg.request_id, msg.worker_id, msg.reply_addr, msg.prefill_worker_id or None)
        log.info("request adopted", request_id=msg.request_id, worker_id=msg.worker_id,
                 prefill_worker_id=msg.prefill_worker_id or None)

    async def _abort_legs(self, entry: InFlight, msg: AbortRequest, except_worker_id: str | None = None) -> None:
        """Tell each live worker holding a leg of the request to stop it (both, for a PD request: the
        prefill side may hold its pages under a lease)."""
        for worker_id in dict.fromkeys((entry.worker_id, entry.prefill_worker_id)):
            worker = self.registry.get(worker_id) if worker_id and worker_id != except_worker_id else None
            if worker is not None:
                await self._pushes.send(worker.addr, msg)

    async def _on_heartbeat(self, hb: WorkerHeartbeat, identity: bytes | None) -> None:
        kind, old = self.registry.on_heartbeat(hb, time.monotonic())
        if hb.metrics is not None:
            self._engine_metrics[hb.worker_id] = hb.metrics
        else:
            self._engine_metrics.pop(hb.worker_id, None)
        if kind is HeartbeatKind.NEW:
            log.info("worker registered", worker_id=hb.worker_id, addr=hb.addr, model_id=hb.model_id, role=hb.role)
        elif kind is HeartbeatKind.RESTARTED:
            log.warning("worker restarted; failing its old requests", worker_id=hb.worker_id)
            self._pushes.drop(old.addr)
            await self._fail_worker_requests(hb.worker_id, "worker restarted")
        if len(self.queue):
            await self._drain()

    async def _on_finished(self, msg: RequestFinished, identity: bytes | None) -> None:
        entry = self.inflight.get(msg.request_id)
        if entry is None:
            if not msg.handed_off:
                self.handovers.note_finish(msg.request_id, time.monotonic())  # another scheduler's, or not adopted yet
            return
        if entry.worker_id == msg.worker_id:
            self.inflight.pop(msg.request_id)
        elif entry.prefill_worker_id == msg.worker_id and not msg.handed_off:
            self.inflight.pop(msg.request_id)  # the prefill side ended it itself (its first token was the last)
        else:
            return  # NOTE: a handoff closes the prefill leg only when the decode side accepts it
        if len(self.queue):
            await self._drain()  # a worker seat is free again

    async def _on_handoff_accepted(self, msg: HandoffAccepted, identity: bytes | None) -> None:
        entry = self.inflight.get(msg.request_id)
        if entry is not None and entry.worker_id == msg.worker_id:
            self.inflight.close_prefill(msg.request_id)

    async def _on_worker_gone(self, msg: WorkerGone, identity: bytes | None) -> None:
        worker = self.registry.remove(msg.worker_id)
        if worker is not None:
            log.info("worker left", worker_id=msg.worker_id)
            self._pushes.drop(worker.addr)
        await self._fail_worker_requests(msg.worker_id, "worker left")

    async def _on_status(self, msg: StatusRequest, identity: bytes | None) -> None:
        reply = StatusReply(model_ids=self.registry.model_ids(), num_workers=len(self.registry),
                            num_queued=len(self.queue), num_in_flight=len(self.inflight),
                            incarnation=self.incarnation)
        await self._reply(reply, identity)

    async def _on_metrics(self, msg: MetricsRequest, identity: bytes | None) -> None:
        await self._reply(MetricsReply(msg.request_id, self.metrics.render()), identity)

    async def _reply(self, msg: StatusReply | MetricsReply, identity: bytes | None) -> None:
        """Answer on the ROUTER without waiting: a peer with a full queue (it reads none of its replies) gets
        nothing, counted, rather than the receive loop waiting on it."""
        dropped = await transport.send(self._router, msg, identity, max_wait_s=0.0)
        if dropped is not None:
            self._num_reply_drops[dropped] += 1

    def _dropped_messages(self) -> dict[str, float]:
        """Messages given up, by reason: replies on the ROUTER and sends to workers and tokenizers."""
        return {reason.value: self._num_reply_drops[reason] + self._pushes.num_dropped[reason]
                for reason in transport.DropReason}

    def _live_engine_metrics(self) -> list[tuple[str, EngineMetrics]]:
        """(worker_id, latest EngineMetrics) of each worker in the registry; forgets the workers that left it."""
        for worker_id in [w for w in self._engine_metrics if w not in self.registry]:
            del self._engine_metrics[worker_id]
        return sorted(self._engine_metrics.items())

    async def _tick(self) -> None:
        """Periodic: drop workers that missed heartbeats, fail queued requests past their deadline and adopted
        requests whose worker never showed up, and forget pending entries and aborts whose time is up."""
        self.pending.expire(time.monotonic())
        self.handovers.expire(time.monotonic())
        await self._check_unconfirmed(time.monotonic())
        for worker in self.registry.expire(time.monotonic(), self.config.heartbeat_timeout_s):
            log.warning("worker missed heartbeats; dropped", worker_id=worker.worker_id)
            self._pushes.drop(worker.addr)
            await self._fail_worker_requests(worker.worker_id, "worker died")
            if self.config.cache_index_addr:
                await self._pushes.send(self.config.cache_index_addr, WorkerGone(worker.worker_id))
        for waiting in self.queue.pop_expired(time.time()):
            request = waiting.request
            if request.deadline_s is not None and waiting.deadline_s >= request.deadline_s:
                await self._fail(request.request_id, request.reply_addr, 504,
                                 "the request's deadline passed while it waited for a worker")
            else:
                await self._fail(request.request_id, request.reply_addr, 503,
                                 f"no worker could take the request within {self.config.max_queue_wait_s:g} s")

    async def _check_unconfirmed(self, now_s: float) -> None:
        """Fail adopted requests whose workers this scheduler has not heard of within a heartbeat timeout."""
        for request_id in self.handovers.due_failures(now_s, self._legs, self.registry):
            entry = self.inflight.pop(request_id)
            if entry is not None:
                await self._fail(request_id, entry.reply_addr, 503, "its worker is gone", worker_lost=True)
                await self._abort_legs(entry, AbortRequest(request_id, "worker gone"))

    def _legs(self, request_id: str) -> list[str] | None:
        """The worker ids the request runs on here (decode, then prefill if any); None when not in flight."""
        entry = self.inflight.get(request_id)
        return None if entry is None else [w for w in (entry.worker_id, entry.prefill_worker_id) if w]

    async def _fail_worker_requests(self, worker_id: str, reason: str) -> None:
        for entry in self.inflight.pop_worker(worker_id):
            await self._fail(entry.request_id, entry.reply_addr, 503, reason, worker_lost=True)
            await self._abort_legs(entry, AbortRequest(entry.request_id, reason), except_worker_id=worker_id)

    async def _fail(self, request_id: str, reply_addr: str, status: int, message: str, code: str = "server_error",
                    retry_after_s: float | None = None, worker_lost: bool = False) -> None:
        await self._to_tokenizer(reply_addr, GenerateError(request_id, status, code, message, retry_after_s,
                                                           worker_lost=worker_lost))

    async def _to_tokenizer(self, reply_addr: str, msg: GenerateError | RequestRouted) -> None:
        try:
            await self._pushes.send(reply_addr, msg)
        except zmq.ZMQError as exc:
            log.warning("cannot reach reply_addr", request_id=msg.request_id, reply_addr=reply_addr, error=str(exc))
