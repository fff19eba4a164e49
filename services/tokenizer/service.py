"""The tokenizer actor: prompts from gateways become TokenizedRequests; workers' tokens become GenerateChunks.

Schedulers are pinged (StatusRequest) every scheduler_ping_interval_s. One that cannot be reached or stays silent
for scheduler_timeout_s is lost (and one that answers with a new incarnation has forgotten its requests): new
requests go to the live ones, and at the next ping each request it had is handed over (AdoptRequest) if it runs on
a worker (RequestRouted or tokens came), else re-sent. A silent one may only be busy: while no other is live, its
requests stay with it for scheduler_give_up_s, and are its own again if it answers as the same incarnation. A
request whose worker died before it streamed anything is re-sent too; each request at most max_resends times.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import jinja2
import structlog
import zmq
import zmq.asyncio

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.detokenizer import SampleDetokenizer, SampleStep, token_texts
from services.tokenizer.model_files import Tokenizer
from shared.actor import Actor
from shared.hashing import hash_blocks
from shared.messages import (
    AbortRequest,
    AdoptRequest,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    RequestRouted,
    StatusReply,
    StatusRequest,
    TokenBatch,
    TokenizedRequest,
    TokenizerInbound,
    TokenizerStreamInbound,
    TokenOutputs,
    encode,
)
from shared.transport import MAX_FRAME_BYTES, advertised, bind, context, receive_forever, send

log = structlog.get_logger(__name__)

MIN_THREADED_PROMPT_CHARS = 4096  # longer prompts are tokenized off the event loop
MAX_TOKEN_ID = (1 << 32) - 1  # block hashes pack ids as uint32
MAX_REMEMBERED_ABORTS = 65_536
SILENT = "stopped answering"  # the reason a scheduler that is still connected is lost


class PromptError(ValueError):
    """The request itself is invalid (HTTP 400)."""


@dataclass(eq=False)
class SchedulerLink:
    """One scheduler as this tokenizer sees it: an IMMEDIATE DEALER (a send fails at once while the scheduler is
    not connected, so nothing queues up for a dead one) and its last answer to a ping."""

    addr: str
    sock: zmq.asyncio.Socket
    last_seen_s: float  # monotonic: its last StatusReply (or start-up)
    is_live: bool = True
    epoch: int = 0  # one more at each loss, give-up or restart: requests sent before then are orphans
    silent_since_s: float | None = None  # monotonic: lost for silence, not given up yet (its requests wait for it)
    has_answered: bool = False
    incarnation: str = ""
    version: int = 1  # its protocol version: AdoptRequest needs 2


@dataclass
class RequestState:
    """What the tokenizer remembers of one request between its prompt and its last chunk."""

    request_id: str
    gateway: bytes
    samples: list[SampleDetokenizer] = field(default_factory=list)
    wants_token_texts: bool = False
    worker_finished: set[int] = field(default_factory=set)  # sample indexes the worker has ended
    request: TokenizedRequest | None = None  # kept until a token comes, to re-send it
    scheduler: SchedulerLink | None = None  # the scheduler that has it (None: not sent yet, or none is live)
    scheduler_epoch: int = 0  # the scheduler's epoch when it got the request
    worker_id: str = ""  # where it runs: from RequestRouted or its first tokens ("" while unknown)
    prefill_worker_id: str = ""  # PD: its prefill worker, from RequestRouted
    is_routed: bool = False  # worker_id came from RequestRouted: tokens from any other worker are a stray copy's
    is_handed_off: bool = False  # PD: its decode worker has streamed, so the prefill leg is closed
    has_output: bool = False  # a worker streamed it something: it is never re-sent
    num_resends: int = 0
    refused_workers: set[str] = field(default_factory=set)  # workers running a stray copy, told to stop it

    @property
    def is_finished(self) -> bool:
        return bool(self.samples) and all(s.is_finished for s in self.samples)


class TokenizerService(Actor):
    """ROUTER for gateways, PULL for the token stream, one DEALER per scheduler (requests, aborts, pings)."""

    name = "tokenizer"

    def __init__(self, config: TokenizerConfig, tokenizer: Tokenizer | None, model_id: str) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.vocab_size = len(tokenizer) if tokenizer is not None else MAX_TOKEN_ID + 1
        self.requests: dict[str, RequestState] = {}
        self._admitting: set[asyncio.Future] = set()
        self._gateway_handlers: dict[type, Any] = {GenerateRequest: self.on_generate,
                                                   AbortRequest: self.on_gateway_abort}
        self._stream_handlers: dict[type, Any] = {TokenBatch: self.on_token_batch,
                                                  GenerateError: self.on_stream_error,
                                                  RequestRouted: self.on_routed}
        self.reply_addr = advertised(config.stream_addr)  # where workers and schedulers send to this tokenizer
        self.links: list[SchedulerLink] = []
        self._next_link = 0
        self._aborted: OrderedDict[str, None] = OrderedDict()  # recent aborts sent: their late tokens are expected

    async def start(self) -> None:
        addrs = self.config.scheduler_addr_list
        if not addrs:
            raise ValueError("scheduler_addrs is empty")
        self.router = bind(zmq.ROUTER, self.config.tokenizer_addr)
        self.stream = bind(zmq.PULL, self.config.stream_addr)
        self.links = [SchedulerLink(addr, _scheduler_dealer(addr), time.monotonic()) for addr in addrs]
        self.spawn(receive_forever(self.router, TokenizerInbound, self._dispatch_gateway, has_identity=True),
                   "gateway-receive")
        self.spawn(receive_forever(self.stream, TokenizerStreamInbound, self._dispatch_stream), "stream-receive")
        for index, link in enumerate(self.links):
            self.spawn(receive_forever(link.sock, StatusReply, self._status_handler(link)),
                       f"scheduler-receive-{index}")
        self.every(self.config.scheduler_ping_interval_s, self._ping, "scheduler-ping")
        log.info("serving", model_id=self.model_id, has_tokenizer=self.tokenizer is not None,
                 tokenizer_addr=self.config.tokenizer_addr, stream_addr=self.config.stream_addr)

    async def close(self) -> None:
        for task in self._admitting:
            task.cancel()
        for sock in (self.router, self.stream, *(link.sock for link in self.links)):
            sock.close(linger=0)

    async def _dispatch_gateway(self, msg: Any, identity: bytes | None) -> None:
        if identity is None:
            log.warning("gateway message without identity dropped", message=type(msg).__name__)
            return
        await self._gateway_handlers[type(msg)](msg, identity)

    async def _dispatch_stream(self, msg: Any, _identity: bytes | None) -> None:
        await self._stream_handlers[type(msg)](msg)

    # gateway → tokenizer

    async def on_generate(self, req: GenerateRequest, gateway: bytes) -> None:
        if req.request_id in self.requests:
            await self._reply_error(gateway, req.request_id, PromptError("duplicate request_id in flight"))
            return
        if len(self.requests) >= self.config.max_requests:
            await send(self.router, GenerateError(
                req.request_id, 429, "rate_limit_error",
                f"the tokenizer has {self.config.max_requests} requests in flight (its max_requests); retry shortly",
                retry_after_s=1.0), gateway)
            return
        state = self.requests[req.request_id] = RequestState(req.request_id, gateway)
        if _num_prompt_chars(req) < MIN_THREADED_PROMPT_CHARS:
            await self._admit(req, state)
            return
        task = asyncio.ensure_future(self._admit(req, state, is_threaded=True))
        self._admitting.add(task)  # NOTE: keeps the task alive; the receive loop goes on meanwhile
        task.add_done_callback(self._admitting.discard)

    async def _admit(self, req: GenerateRequest, state: RequestState, is_threaded: bool = False) -> None:
        """Tokenize, remember and send one request to the schedulers, or answer it with a GenerateError."""
        try:
            if is_threaded:
                tokenized = await asyncio.to_thread(self._tokenized, req)
            else:
                tokenized = self._tokenized(req)
            if self.requests.get(req.request_id) is not state:
                return  # aborted while tokenizing
            state.samples = [SampleDetokenizer(self.tokenizer, req.stop, req.skip_special_tokens,
                                               tokenized.prompt_token_ids) for _ in range(req.sampling.n)]
            state.wants_token_texts = req.sampling.logprobs is not None and self.tokenizer is not None
            state.request = tokenized
            if not await self._send_request(state):
                del self.requests[req.request_id]
                await send(self.router, GenerateError(req.request_id, 503, "server_error",
                                                      "no scheduler is reachable; retry shortly",
                                                      retry_after_s=1.0), state.gateway)
        except Exception as exc:  # noqa: BLE001 - one bad request must not affect the others
            if self.requests.get(req.request_id) is state:
                del self.requests[req.request_id]
            await self._reply_error(state.gateway, req.request_id, exc)

    async def on_gateway_abort(self, abort: AbortRequest, _gateway: bytes) -> None:
        # NOTE: forwarded even when unknown here: a gateway's DEALER may send the abort to another replica.
        state = self.requests.pop(abort.request_id, None)
        await self._abort_everywhere(AbortRequest(abort.request_id, abort.reason,
                                                  state.worker_id if state is not None else ""))

    def _tokenized(self, req: GenerateRequest) -> TokenizedRequest:
        """The TokenizedRequest for req (may run in a worker thread); bad input raises PromptError."""
        if req.sampling.n < 1:
            raise PromptError("n must be at least 1")
        ids = self._prompt_ids(req)
        return TokenizedRequest(
            request_id=req.request_id, prompt_token_ids=ids,
            block_hashes=hash_blocks(ids, self.config.page_size, self.model_id), sampling=req.sampling,
            reply_addr=self.reply_addr, arrival_s=time.time(), deadline_s=req.deadline_s, model_id=self.model_id,
            wants_routed=True)

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt as token ids, validated."""
        num_set = sum(p is not None for p in (req.prompt_text, req.prompt_token_ids, req.messages))
        if num_set != 1:
            raise PromptError("exactly one of prompt_text, prompt_token_ids and messages must be set")
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif self.tokenizer is None:
            raise PromptError(f"model {self.model_id} has no tokenizer: send the prompt as token ids")
        elif req.messages is not None:
            ids = list(self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in req.messages],
                add_generation_prompt=True, tokenize=True, return_dict=False))
        else:
            ids = list(self.tokenizer.encode(req.prompt_text))
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) > self.config.max_prompt_tokens:
            raise PromptError(f"the prompt has {len(ids)} tokens, more than the maximum "
                              f"{self.config.max_prompt_tokens}")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    # workers / schedulers → tokenizer

    async def on_token_batch(self, batch: TokenBatch) -> None:
        for out in batch.outputs:
            state = self.requests.get(out.request_id)
            if state is None and out.finish_reason is None and out.request_id not in self._aborted:
                # NOTE: nobody reads these tokens (a copy routed twice, or a request of this tokenizer's last run)
                log.info("tokens for a request not held here; stopping it", request_id=out.request_id,
                         worker_id=batch.worker_id)
                await self._abort_everywhere(AbortRequest(out.request_id, "unknown", batch.worker_id))
            if state is None or not 0 <= out.index < len(state.samples):
                continue
            if not await self._is_from_its_worker(state, batch.worker_id):
                continue
            try:
                await self._on_output(out, state)
            except Exception as exc:  # noqa: BLE001 - a failure ends this request only
                log.exception("detokenizing failed", request_id=out.request_id)
                self.requests.pop(out.request_id, None)
                await self._reply_error(state.gateway, out.request_id, exc, status=500)
                await self._abort_everywhere(AbortRequest(out.request_id, "error", state.worker_id))

    async def _is_from_its_worker(self, state: RequestState, worker_id: str) -> bool:
        """Note where the request streams from; False for a stray copy's tokens (a re-sent request whose first
        copy ran after all), which is told to stop."""
        if not state.worker_id:
            state.worker_id = worker_id  # before RequestRouted, or from a scheduler that does not send it
        elif state.is_routed and worker_id not in (state.worker_id, state.prefill_worker_id):
            if worker_id not in state.refused_workers:
                state.refused_workers.add(worker_id)
                log.warning("tokens from a stray copy; stopping it", request_id=state.request_id,
                            worker_id=worker_id, expected_worker_id=state.worker_id)
                await self._abort_everywhere(AbortRequest(state.request_id, "duplicate", worker_id))
            return False
        if worker_id == state.worker_id and state.prefill_worker_id not in ("", worker_id):
            state.is_handed_off = True
        if not state.has_output:
            state.has_output = True
            state.request = None  # never re-sent from now on
        return True

    async def _on_output(self, out: TokenOutputs, state: RequestState) -> None:
        if out.finish_reason is not None:
            state.worker_finished.add(out.index)
        sample = state.samples[out.index]
        if sample.is_finished:
            return
        step = sample.step(out.token_ids, is_final=out.finish_reason is not None)
        chunk = self._chunk(out, step, state)
        if chunk.text or chunk.token_ids or chunk.finish_reason:
            await send(self.router, chunk, state.gateway)
        if state.is_finished:
            del self.requests[out.request_id]
            if len(state.worker_finished) < len(state.samples):
                await self._abort_everywhere(AbortRequest(out.request_id, "stop", state.worker_id))

    def _chunk(self, out: TokenOutputs, step: SampleStep, state: RequestState) -> GenerateChunk:
        ids = out.token_ids[:step.num_tokens]
        return GenerateChunk(
            request_id=out.request_id, index=out.index, text=step.text, token_ids=ids,
            logprobs=out.logprobs[:step.num_tokens] if out.logprobs is not None else None,
            token_texts=token_texts(self.tokenizer, ids) if state.wants_token_texts else None,
            finish_reason="stop" if step.is_stopped else out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens)

    async def on_stream_error(self, err: GenerateError) -> None:
        state = self.requests.get(err.request_id)
        if state is None:
            return
        # NOTE: a PD request's other leg was told to abort it; a re-sent copy could meet that abort there.
        if err.worker_lost and not state.prefill_worker_id and await self._resend(state, err.message):
            return
        del self.requests[err.request_id]
        await send(self.router, err, state.gateway)

    async def on_routed(self, msg: RequestRouted) -> None:
        state = self.requests.get(msg.request_id)
        if state is None:
            return
        if state.has_output and state.worker_id not in (msg.worker_id, msg.prefill_worker_id):
            # A stray copy of the re-sent request streamed first: it stays; the copy just routed is stopped.
            state.refused_workers.add(msg.worker_id)
            await self._abort_everywhere(AbortRequest(msg.request_id, "duplicate", msg.worker_id))
            state.is_routed = True
            await self._adopt(state)
            return
        state.worker_id, state.prefill_worker_id, state.is_routed = msg.worker_id, msg.prefill_worker_id, True

    async def _abort_everywhere(self, abort: AbortRequest) -> None:
        """Send abort to every live scheduler: the one holding the request stops it; given abort.worker_id, the
        others forward it to that worker (the scheduler that routed the request may be the one that died)."""
        self._aborted[abort.request_id] = None
        if len(self._aborted) > MAX_REMEMBERED_ABORTS:
            self._aborted.popitem(last=False)
        for link in self.links:
            if link.is_live or link.silent_since_s is not None:  # a silent one may still hold the request
                await self._send_to(link, abort)

    # schedulers: liveness, sending, handing requests over

    def _status_handler(self, link: SchedulerLink) -> Any:
        async def handle(reply: StatusReply, _identity: bytes | None) -> None:
            await self._on_status(link, reply)
        return handle

    async def _ping(self) -> None:
        """Lose the live schedulers that stopped answering, give up on silent ones, re-home the requests of lost
        ones, and ping every scheduler (a lost one comes back by answering)."""
        now_s = time.monotonic()
        for link in self.links:
            if link.is_live and now_s - link.last_seen_s > self.config.scheduler_timeout_s:
                self._lose(link, SILENT)
        self._settle_silent(now_s)
        # NOTE: re-homed here, not at the loss: RequestRouted sent just before a kill is read by now.
        await self._rehome_orphans()
        for link in self.links:
            await self._send_to(link, StatusRequest())

    async def _on_status(self, link: SchedulerLink, reply: StatusReply) -> None:
        was_silent, link.silent_since_s = link.silent_since_s is not None, None
        if link.incarnation and reply.incarnation != link.incarnation and (link.is_live or was_silent):
            log.warning("scheduler restarted; its requests are handed over or re-sent", addr=link.addr)
            link.epoch += 1
        elif was_silent and (num_kept := self._num_requests(link)):
            # NOTE: same incarnation: it still holds what it had (their epoch is still its own); a re-send would
            # make it route a request twice.
            log.info("scheduler answers again; its requests were kept", addr=link.addr, num_requests=num_kept)
        link.last_seen_s = time.monotonic()
        link.has_answered, link.incarnation, link.version = True, reply.incarnation, reply.version
        if not link.is_live:
            link.is_live = True
            log.info("scheduler live", addr=link.addr, incarnation=reply.incarnation or None)

    def _lose(self, link: SchedulerLink, reason: str) -> None:
        """No new requests go to link. One lost for silence keeps its requests until _settle_silent gives up on it;
        one that cannot be reached (its socket is not connected) is gone at once."""
        if not link.is_live:
            if link.silent_since_s is not None and reason != SILENT:
                self._give_up(link, reason)
            return
        link.is_live = False
        num_requests = self._num_requests(link)
        if link.has_answered or num_requests:
            log.warning("scheduler lost", addr=link.addr, reason=reason, num_requests=num_requests)
        else:
            log.info("scheduler not up yet", addr=link.addr, reason=reason)
        if reason == SILENT:
            link.silent_since_s = time.monotonic()
        else:
            link.epoch += 1

    def _settle_silent(self, now_s: float) -> None:
        """Give up on each silent scheduler whose requests another live one can take, or that stayed silent for
        scheduler_give_up_s: its requests become orphans. Until then they wait for it, neither re-sent nor failed
        (it may only be busy, and a re-sent request would be routed twice)."""
        has_live = any(link.is_live for link in self.links)
        for link in self.links:
            if link.silent_since_s is None:
                continue
            if has_live:
                self._give_up(link, "another scheduler is live")
            elif now_s - link.silent_since_s >= self.config.scheduler_give_up_s:
                self._give_up(link, f"silent for scheduler_give_up_s ({self.config.scheduler_give_up_s} s)")

    def _give_up(self, link: SchedulerLink, reason: str) -> None:
        link.silent_since_s = None
        link.epoch += 1
        num_requests = self._num_requests(link)
        if num_requests:
            log.warning("silent scheduler given up", addr=link.addr, reason=reason, num_requests=num_requests)

    def _num_requests(self, link: SchedulerLink) -> int:
        return sum(s.scheduler is link for s in self.requests.values())

    async def _rehome_orphans(self) -> None:
        """Requests of a lost or restarted scheduler, and those running on a worker that no scheduler took over:
        hand each running one over to a live scheduler; re-send the others, or fail them with 503."""
        orphans = [s for s in self.requests.values() if (s.worker_id if s.scheduler is None
                                                         else s.scheduler_epoch != s.scheduler.epoch)]
        for state in orphans:
            if self.requests.get(state.request_id) is not state:
                continue  # ended meanwhile
            state.scheduler = None
            if state.worker_id:
                await self._adopt(state)
            elif not await self._resend(state, "its scheduler is gone"):
                del self.requests[state.request_id]
                await send(self.router, GenerateError(
                    state.request_id, 503, "server_error", "the scheduler holding the request is gone and it "
                    "could not be re-sent (no other is live, or it was re-sent max_resends times)",
                    retry_after_s=1.0), state.gateway)

    async def _adopt(self, state: RequestState) -> None:
        """Hand a request that runs on a worker to a live scheduler; with none, it streams on unheld (and is
        handed over at a later ping)."""
        adopt = AdoptRequest(state.request_id, state.worker_id, self.reply_addr,
                             "" if state.is_handed_off else state.prefill_worker_id)
        for link in self._live_links():
            if link.is_live and link.version >= 2 and await self._send_to(link, adopt):
                state.scheduler, state.scheduler_epoch = link, link.epoch
                log.info("request handed over", request_id=state.request_id, worker_id=state.worker_id,
                         addr=link.addr)
                return

    async def _resend(self, state: RequestState, reason: str) -> bool:
        """Send a request that has streamed nothing to a live scheduler again, within max_resends."""
        if state.request is None or state.has_output or state.num_resends >= self.config.max_resends:
            return False
        state.num_resends += 1
        state.worker_id, state.prefill_worker_id, state.is_routed = "", "", False
        if not await self._send_request(state):
            return False
        log.info("request re-sent", request_id=state.request_id, reason=reason, num_resends=state.num_resends)
        return True

    async def _send_request(self, state: RequestState) -> bool:
        """Send state.request to the next live scheduler (round robin); False when none takes it."""
        for link in self._live_links():
            if link.is_live and await self._send_to(link, state.request):
                state.scheduler, state.scheduler_epoch = link, link.epoch
                return True
        return False

    def _live_links(self) -> list[SchedulerLink]:
        """The live schedulers, starting one further along at each call."""
        start = self._next_link
        self._next_link = (start + 1) % len(self.links)
        return [link for link in self.links[start:] + self.links[:start] if link.is_live]

    async def _send_to(self, link: SchedulerLink, msg: Any) -> bool:
        """Send without waiting; a scheduler that is not connected (or is full) is lost at once."""
        try:
            await link.sock.send_multipart([encode(msg)], flags=zmq.DONTWAIT)
        except zmq.Again:
            self._lose(link, "unreachable")
            return False
        return True

    async def _reply_error(self, gateway: bytes, request_id: str, exc: Exception, status: int | None = None) -> None:
        is_client_error = status is None and isinstance(exc, (ValueError, TypeError, jinja2.TemplateError))
        if not is_client_error:
            log.error("request failed", request_id=request_id, error=repr(exc)[:500])
        error = GenerateError(
            request_id=request_id, status=400 if is_client_error else (status or 500),
            code="invalid_request_error" if is_client_error else "server_error", message=str(exc)[:1000])
        await send(self.router, error, gateway)


def _scheduler_dealer(addr: str) -> zmq.asyncio.Socket:
    sock = context().socket(zmq.DEALER)
    for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_FRAME_BYTES), (zmq.SNDHWM, 100_000),
                          (zmq.IMMEDIATE, 1)):
        sock.setsockopt(option, value)
    sock.connect(addr)
    return sock


def _num_prompt_chars(req: GenerateRequest) -> int:
    if req.prompt_text is not None:
        return len(req.prompt_text)
    return sum(len(m.content) for m in req.messages or ())
