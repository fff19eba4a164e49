"""The tokenizer actor: prompts from gateways become TokenizedRequests; workers' tokens become GenerateChunks."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import jinja2
import structlog
import zmq

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.detokenizer import SampleDetokenizer, SampleStep, token_texts
from services.tokenizer.model_files import Tokenizer
from shared.actor import Actor
from shared.hashing import hash_blocks
from shared.messages import (
    AbortRequest,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    TokenBatch,
    TokenizedRequest,
    TokenizerInbound,
    TokenizerStreamInbound,
    TokenOutputs,
)
from shared.transport import advertised, bind, connect, receive_forever, send

log = structlog.get_logger(__name__)

MIN_THREADED_PROMPT_CHARS = 4096  # longer prompts are tokenized off the event loop
MAX_TOKEN_ID = (1 << 32) - 1  # block hashes pack ids as uint32


class PromptError(ValueError):
    """The request itself is invalid (HTTP 400)."""


@dataclass
class RequestState:
    """What the tokenizer remembers of one request between its prompt and its last chunk."""

    gateway: bytes
    samples: list[SampleDetokenizer] = field(default_factory=list)
    wants_token_texts: bool = False
    worker_finished: set[int] = field(default_factory=set)  # sample indexes the worker has ended

    @property
    def is_finished(self) -> bool:
        return bool(self.samples) and all(s.is_finished for s in self.samples)


class TokenizerService(Actor):
    """ROUTER for gateways, PULL for the token stream, one DEALER to all schedulers plus one each for aborts."""

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
                                                  GenerateError: self.on_stream_error}

    async def start(self) -> None:
        addrs = self.config.scheduler_addr_list
        if not addrs:
            raise ValueError("scheduler_addrs is empty")
        self.router = bind(zmq.ROUTER, self.config.tokenizer_addr)
        self.stream = bind(zmq.PULL, self.config.stream_addr)
        self.scheduler = connect(zmq.DEALER, addrs[0])
        for addr in addrs[1:]:
            self.scheduler.connect(addr)
        self.abort_sockets = [connect(zmq.DEALER, addr) for addr in addrs]
        self.spawn(receive_forever(self.router, TokenizerInbound, self._dispatch_gateway, has_identity=True),
                   "gateway-receive")
        self.spawn(receive_forever(self.stream, TokenizerStreamInbound, self._dispatch_stream), "stream-receive")
        self.spawn(receive_forever(self.scheduler, TokenizerStreamInbound, self._dispatch_stream),
                   "scheduler-receive")
        log.info("serving", model_id=self.model_id, has_tokenizer=self.tokenizer is not None,
                 tokenizer_addr=self.config.tokenizer_addr, stream_addr=self.config.stream_addr)

    async def close(self) -> None:
        for task in self._admitting:
            task.cancel()
        for sock in (self.router, self.stream, self.scheduler, *self.abort_sockets):
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
        state = self.requests[req.request_id] = RequestState(gateway)
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
            await send(self.scheduler, tokenized)
        except Exception as exc:  # noqa: BLE001 - one bad request must not affect the others
            if self.requests.get(req.request_id) is state:
                del self.requests[req.request_id]
            await self._reply_error(state.gateway, req.request_id, exc)

    async def on_gateway_abort(self, abort: AbortRequest, _gateway: bytes) -> None:
        # NOTE: forwarded even when unknown here: a gateway's DEALER may send the abort to another replica.
        self.requests.pop(abort.request_id, None)
        await self._abort_everywhere(abort)

    def _tokenized(self, req: GenerateRequest) -> TokenizedRequest:
        """The TokenizedRequest for req (may run in a worker thread); bad input raises PromptError."""
        if req.sampling.n < 1:
            raise PromptError("n must be at least 1")
        ids = self._prompt_ids(req)
        return TokenizedRequest(
            request_id=req.request_id, prompt_token_ids=ids,
            block_hashes=hash_blocks(ids, self.config.page_size, self.model_id), sampling=req.sampling,
            reply_addr=advertised(self.config.stream_addr), arrival_s=time.time(), deadline_s=req.deadline_s,
            model_id=self.model_id)

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
            if state is None or not 0 <= out.index < len(state.samples):
                continue
            try:
                await self._on_output(out, state)
            except Exception as exc:  # noqa: BLE001 - a failure ends this request only
                log.exception("detokenizing failed", request_id=out.request_id)
                self.requests.pop(out.request_id, None)
                await self._reply_error(state.gateway, out.request_id, exc, status=500)
                await self._abort_everywhere(AbortRequest(out.request_id, reason="error"))

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
                await self._abort_everywhere(AbortRequest(out.request_id, reason="stop"))

    def _chunk(self, out: TokenOutputs, step: SampleStep, state: RequestState) -> GenerateChunk:
        ids = out.token_ids[:step.num_tokens]
        return GenerateChunk(
            request_id=out.request_id, index=out.index, text=step.text, token_ids=ids,
            logprobs=out.logprobs[:step.num_tokens] if out.logprobs is not None else None,
            token_texts=token_texts(self.tokenizer, ids) if state.wants_token_texts else None,
            finish_reason="stop" if step.is_stopped else out.finish_reason,
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens)

    async def on_stream_error(self, err: GenerateError) -> None:
        state = self.requests.pop(err.request_id, None)
        if state is not None:
            await send(self.router, err, state.gateway)

    async def _abort_everywhere(self, abort: AbortRequest) -> None:
        for sock in self.abort_sockets:
            await send(sock, abort)

    async def _reply_error(self, gateway: bytes, request_id: str, exc: Exception, status: int | None = None) -> None:
        is_client_error = status is None and isinstance(exc, (ValueError, TypeError, jinja2.TemplateError))
        if not is_client_error:
            log.error("request failed", request_id=request_id, error=repr(exc)[:500])
        error = GenerateError(
            request_id=request_id, status=400 if is_client_error else (status or 500),
            code="invalid_request_error" if is_client_error else "server_error", message=str(exc)[:1000])
        await send(self.router, error, gateway)


def _num_prompt_chars(req: GenerateRequest) -> int:
    if req.prompt_text is not None:
        return len(req.prompt_text)
    return sum(len(m.content) for m in req.messages or ())
