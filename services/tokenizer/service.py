"""The tokenizer actor: prompts from gateways become TokenizedRequests; workers' tokens become GenerateChunks.

Schedulers are pinged (StatusRequest) every scheduler_ping_interval_s. One that cannot be reached or stays silent
for scheduler_timeout_s is lost (and one that answers with a new incarnation has forgotten its requests): new
requests go to the live ones, and at the next ping each request it had is handed over (AdoptRequest) if it runs on
a worker (RequestRouted or tokens came), else re-sent. A silent one may only be busy: while no other is live, its
requests stay with it for scheduler_give_up_s, and are its own again if it answers as the same incarnation. A
request whose worker died before it streamed anything is re-sent too; each request at most max_resends times.
These decisions are request_table.py's; this shell owns the sockets and the detokenizers.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import jinja2
import structlog
import zmq
import zmq.asyncio

from services.tokenizer.chat_prompt import chat_prompt_ids
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.detokenizer import SampleDetokenizer, SampleStep
from services.tokenizer.model_files import Tokenizer
from services.tokenizer.request_table import Action, Fail, RequestTable, Send
from services.tokenizer.token_pieces import TokenPieces
from services.tokenizer.tool_prompt import template_inputs
from shared.actor import Actor
from shared.hashing import hash_blocks
from shared.messages import (
    AbortRequest,
    DetokenizeReply,
    DetokenizeRequest,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    RequestRouted,
    StatusReply,
    TokenBatch,
    TokenizedRequest,
    TokenizeReply,
    TokenizeRequest,
    TokenizerInbound,
    TokenizerPing,
    TokenizerPong,
    TokenizerStreamInbound,
    TokenLogprobEntry,
    TokenOutputs,
    encode,
)
from shared.sampling import (SamplingError, SamplingParams, check_logit_bias_ids, context_length_error,
                             prompt_length_error)
from shared.transport import MAX_FRAME_BYTES, advertised, bind, context, receive_forever, send

log = structlog.get_logger(__name__)

MIN_THREADED_PROMPT_CHARS = 4096  # longer prompts are tokenized off the event loop
MAX_TOKEN_ID = (1 << 32) - 1  # block hashes pack ids as uint32


class PromptError(ValueError):
    """The request itself is invalid (HTTP 400)."""


@dataclass
class RequestState:
    """What the tokenizer remembers of one request between its prompt and its last chunk."""

    request_id: str
    gateway: bytes
    samples: list[SampleDetokenizer] = field(default_factory=list)
    wants_token_texts: bool = False
    hides_special_logprobs: bool = False  # chat text skips special tokens: so do its logprobs
    prompt_token_ids: list[int] | None = None  # kept when sampling.prompt_logprobs asks for the prompt's logprobs
    worker_finished: set[int] = field(default_factory=set)  # sample indexes the worker has ended

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
        self.pieces = TokenPieces(tokenizer) if tokenizer is not None else None
        self.requests: dict[str, RequestState] = {}
        self._admitting: set[asyncio.Future] = set()
        self._gateway_handlers: dict[type, Any] = {GenerateRequest: self.on_generate,
                                                   AbortRequest: self.on_gateway_abort,
                                                   TokenizeRequest: self.on_tokenize,
                                                   DetokenizeRequest: self.on_detokenize,
                                                   TokenizerPing: self.on_ping}
        self._stream_handlers: dict[type, Any] = {TokenBatch: self.on_token_batch,
                                                  GenerateError: self.on_stream_error,
                                                  RequestRouted: self.on_routed}
        self.reply_addr = advertised(config.stream_addr)  # where workers and schedulers send to this tokenizer
        self.incarnation = uuid.uuid4().hex  # new at every start: a gateway's pings tell a restart from a slow answer
        self.sockets: list[zmq.asyncio.Socket] = []  # one per scheduler, at its index in self.table.links
        self.table: RequestTable  # built at start: its schedulers' clocks start then

    async def start(self) -> None:
        config = self.config
        self.table = RequestTable(config.scheduler_addr_list, time.monotonic(), self.reply_addr,
                                  config.scheduler_timeout_s, config.scheduler_give_up_s, config.max_resends)
        self.router = bind(zmq.ROUTER, self.config.tokenizer_addr)
        self.stream = bind(zmq.PULL, self.config.stream_addr)
        self.sockets = [_scheduler_dealer(link.addr) for link in self.table.links]
        self.spawn(receive_forever(self.router, TokenizerInbound, self._dispatch_gateway, has_identity=True),
                   "gateway-receive")
        self.spawn(receive_forever(self.stream, TokenizerStreamInbound, self._dispatch_stream), "stream-receive")
        for index, sock in enumerate(self.sockets):
            self.spawn(receive_forever(sock, StatusReply, self._status_handler(index)),
                       f"scheduler-receive-{index}")
        self.every(self.config.scheduler_ping_interval_s, self._ping, "scheduler-ping")
        log.info("serving", model_id=self.model_id, has_tokenizer=self.tokenizer is not None,
                 tokenizer_addr=self.config.tokenizer_addr, stream_addr=self.config.stream_addr)

    async def close(self) -> None:
        for task in self._admitting:
            task.cancel()
        for sock in (self.router, self.stream, *self.sockets):
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
            wants_prompt_logprobs = req.sampling.prompt_logprobs is not None
            state.wants_token_texts = (req.sampling.logprobs is not None or wants_prompt_logprobs) and \
                self.tokenizer is not None
            state.prompt_token_ids = tokenized.prompt_token_ids if wants_prompt_logprobs else None
            state.hides_special_logprobs = req.messages is not None and req.skip_special_tokens
            await self._run(self.table.add(tokenized))
        except Exception as exc:  # noqa: BLE001 - one bad request must not affect the others
            if self.requests.get(req.request_id) is state:
                del self.requests[req.request_id]
                self.table.forget(req.request_id, None)
            await self._reply_error(state.gateway, req.request_id, exc)

    async def on_gateway_abort(self, abort: AbortRequest, _gateway: bytes) -> None:
        # NOTE: forwarded even when unknown here: a gateway's DEALER may send the abort to another replica.
        self.requests.pop(abort.request_id, None)
        await self._run(self.table.forget(abort.request_id, abort.reason))

    async def on_ping(self, ping: TokenizerPing, gateway: bytes) -> None:
        """The asking gateway's requests held here (services/gateway/tokenizer_watch.py)."""
        held = [rid for rid, state in self.requests.items() if state.gateway == gateway]
        await send(self.router, TokenizerPong(self.config.tokenizer_addr, self.incarnation, ping.sent_at, held),
                   gateway)

    async def on_tokenize(self, req: TokenizeRequest, gateway: bytes) -> None:
        """The ids of a prompt (/tokenize); long texts are tokenized off the event loop."""
        try:
            ids = await asyncio.to_thread(self._tokenize_ids, req) if _num_prompt_chars(req) >= \
                MIN_THREADED_PROMPT_CHARS else self._tokenize_ids(req)
            reply = TokenizeReply(req.request_id, ids, self.config.max_model_len)
        except Exception as exc:  # noqa: BLE001 - a bad prompt answers its own gateway only
            await self._reply_error(gateway, req.request_id, exc)
            return
        await send(self.router, reply, gateway)

    async def on_detokenize(self, req: DetokenizeRequest, gateway: bytes) -> None:
        """The text of token ids (/detokenize), special tokens included."""
        try:
            if self.tokenizer is None:
                raise PromptError(f"model {self.model_id} has no tokenizer")
            bad = next((i for i in req.token_ids if not 0 <= i < self.vocab_size), None)
            if bad is not None:
                raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            reply = DetokenizeReply(req.request_id, self.tokenizer.decode(req.token_ids))
        except Exception as exc:  # noqa: BLE001 - a bad id answers its own gateway only
            await self._reply_error(gateway, req.request_id, exc)
            return
        await send(self.router, reply, gateway)

    def _tokenize_ids(self, req: TokenizeRequest) -> list[int]:
        """Chat messages: the ids a generation would run (its chat template and checks); a text: its ids with or
        without the tokenizer's special tokens, unchecked (counting an over-long prompt is the point)."""
        if req.messages is not None:
            return self._prompt_ids(GenerateRequest(req.request_id, SamplingParams(), messages=req.messages))
        if self.tokenizer is None:
            raise PromptError(f"model {self.model_id} has no tokenizer")
        if req.prompt_text is None:
            raise PromptError("one of prompt_text and messages must be set")
        return list(self.tokenizer.encode(req.prompt_text, add_special_tokens=req.add_special_tokens))

    def _tokenized(self, req: GenerateRequest) -> TokenizedRequest:
        """The TokenizedRequest for req (may run in a worker thread); bad input raises PromptError."""
        if req.sampling.n < 1:
            raise PromptError("n must be at least 1")
        ids = self._prompt_ids(req)
        self._check_context(len(ids), req.sampling)
        check_logit_bias_ids(req.sampling.logit_bias, self.vocab_size)
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
            messages, tools = template_inputs(self.tokenizer, req.messages, req.tools, req.is_tool_call_required)
            ids = chat_prompt_ids(self.tokenizer, messages, self.config.trust_message_special_tokens, tools)
        else:
            ids = list(self.tokenizer.encode(req.prompt_text))
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise PromptError("the prompt is empty")
        if self.config.max_model_len and len(ids) > self.config.max_prompt_tokens:
            raise prompt_length_error(self.config.max_prompt_tokens, len(ids))
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _check_context(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """The prompt and max_tokens must fit in the model's context (a max_tokens the client did not set needs
        room for one token: the worker clips it to the rest), as the worker checks it, refused here before any
        scheduler or worker sees the request."""
        max_len = self.config.max_model_len
        num_needed = 1 if sampling.is_max_tokens_default else sampling.max_tokens
        if max_len and num_prompt_tokens + num_needed > max_len:
            raise context_length_error(max_len, num_prompt_tokens, sampling.max_tokens)

    # workers / schedulers → tokenizer

    async def on_token_batch(self, batch: TokenBatch) -> None:
        for out in batch.outputs:
            state = self.requests.get(out.request_id)
            if state is None and out.finish_reason is None:
                await self._run(self.table.on_unknown_tokens(out.request_id, batch.worker_id))
            if state is None or not 0 <= out.index < len(state.samples):
                continue
            is_accepted, actions = self.table.on_tokens(out.request_id, batch.worker_id)
            await self._run(actions)
            if not is_accepted:
                continue
            try:
                await self._on_output(out, state)
            except Exception as exc:  # noqa: BLE001 - a failure ends this request only
                log.exception("detokenizing failed", request_id=out.request_id)
                self.requests.pop(out.request_id, None)
                await self._reply_error(state.gateway, out.request_id, exc, status=500)
                await self._run(self.table.forget(out.request_id, "error"))

    async def _on_output(self, out: TokenOutputs, state: RequestState) -> None:
        if out.finish_reason is not None:
            state.worker_finished.add(out.index)
        sample = state.samples[out.index]
        if sample.is_finished:
            return
        step = sample.step(out.token_ids, is_final=out.finish_reason is not None)
        chunk = self._chunk(out, step, state)
        if chunk.text or chunk.token_ids or chunk.finish_reason or chunk.prompt_logprobs:
            await send(self.router, chunk, state.gateway)
        if state.is_finished:
            del self.requests[out.request_id]
            is_worker_done = len(state.worker_finished) == len(state.samples)
            await self._run(self.table.forget(out.request_id, None if is_worker_done else "stop"))

    def _chunk(self, out: TokenOutputs, step: SampleStep, state: RequestState) -> GenerateChunk:
        ids = out.token_ids[:step.num_tokens]
        logprobs = out.logprobs[:step.num_tokens] if out.logprobs is not None else None
        prompt_logprobs = out.prompt_logprobs if state.prompt_token_ids is not None else None
        prompt_ids = state.prompt_token_ids if prompt_logprobs is not None else None
        texts = pieces = None
        if state.wants_token_texts and self.pieces is not None:
            logprobs = self._shown_logprobs(logprobs, state)
            texts = [self.pieces.piece(token_id).text for token_id in ids]
            named = [token_id for entry in logprobs or () for token_id, _ in entry.top]
            prompt_named = [token_id for entry in prompt_logprobs or () if entry is not None
                            for token_id, _ in entry.top]
            pieces = self.pieces.pieces([*ids, *named, *(prompt_ids or ()), *prompt_named])
        return GenerateChunk(
            request_id=out.request_id, index=out.index, text=step.text, token_ids=ids, logprobs=logprobs,
            token_texts=texts, finish_reason="stop" if step.is_stopped else out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens, token_pieces=pieces,
            prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids)

    def _shown_logprobs(self, logprobs: list[TokenLogprobEntry] | None,
                        state: RequestState) -> list[TokenLogprobEntry] | None:
        """Chat logprobs match the message text: the tokens it leaves out (an end-of-turn token) have none.
        NOTE: they stay in token_ids, so usage still counts them."""
        if logprobs is None or not state.hides_special_logprobs or self.pieces is None:
            return logprobs
        return [entry for entry in logprobs if not self.pieces.is_hidden(entry.token_id)]

    async def on_stream_error(self, err: GenerateError) -> None:
        if err.request_id in self.requests:
            await self._run(self.table.on_error(err))

    async def on_routed(self, msg: RequestRouted) -> None:
        await self._run(self.table.on_routed(msg.request_id, msg.worker_id, msg.prefill_worker_id))

    # schedulers: liveness and sending; the table decides

    def _status_handler(self, index: int) -> Any:
        async def handle(reply: StatusReply, _identity: bytes | None) -> None:
            self.table.on_status(index, reply.incarnation, reply.version, time.monotonic())
        return handle

    async def _ping(self) -> None:
        await self._run(self.table.on_ping(time.monotonic()))

    async def _run(self, actions: list[Action]) -> None:
        """Execute the table's actions in order; each send's result goes back to the table, whose answer
        (the next scheduler to try, or a failure) runs before the actions after it."""
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Fail):
                state = self.requests.pop(action.request_id, None)
                if state is not None:
                    await send(self.router, action.error, state.gateway)
            elif not self.table.is_due(action):
                queue.extendleft(reversed(self.table.on_not_due(action)))
            elif await self._send_to(action):
                self.table.on_sent(action)
            else:
                queue.extendleft(reversed(self.table.on_unreachable(action, time.monotonic())))

    async def _send_to(self, action: Send) -> bool:
        """Send without waiting; False when the scheduler is not connected (or is full)."""
        try:
            await self.sockets[action.link].send_multipart([encode(action.msg)], flags=zmq.DONTWAIT)
        except zmq.Again:
            return False
        return True

    async def _reply_error(self, gateway: bytes, request_id: str, exc: Exception, status: int | None = None) -> None:
        is_client_error = status is None and isinstance(exc, (ValueError, TypeError, jinja2.TemplateError))
        if not is_client_error:
            log.error("request failed", request_id=request_id, error=repr(exc)[:500])
        is_coded = is_client_error and isinstance(exc, SamplingError)
        error = GenerateError(
            request_id=request_id, status=400 if is_client_error else (status or 500),
            code="invalid_request_error" if is_client_error else "server_error", message=str(exc)[:1000],
            error_code=exc.code if is_coded else None, param=exc.param if is_coded else None)
        await send(self.router, error, gateway)


def _scheduler_dealer(addr: str) -> zmq.asyncio.Socket:
    sock = context().socket(zmq.DEALER)
    for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_FRAME_BYTES), (zmq.SNDHWM, 100_000),
                          (zmq.IMMEDIATE, 1)):
        sock.setsockopt(option, value)
    sock.connect(addr)
    return sock


def _num_prompt_chars(req: GenerateRequest | TokenizeRequest) -> int:
    if req.prompt_text is not None:
        return len(req.prompt_text)
    return sum(len(m.content) for m in req.messages or ())
