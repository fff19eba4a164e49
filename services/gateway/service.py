"""The gateway actor: aiohttp routes for the OpenAI API, and the ZeroMQ links to tokenizers and schedulers."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from services.gateway.call import Call, api_error
from services.gateway.config import GatewayConfig
from services.gateway.content_encoding import decode_body
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (ApiError, ParsedRequest, check_model, model_not_found, parse_chat_request,
                                       parse_completion_request, parse_detokenize_request, parse_json_body,
                                       parse_tokenize_request)
from services.gateway.responses import (RequestOutput, ToolCallStream, chat_response, chat_role_chunk, chat_chunk,
                                        completion_chunk, completion_response, echo_chunk, usage_chunk)
from services.gateway.tokenizer_watch import TokenizerWatch
from shared import transport
from shared.actor import Actor
from shared.messages import (AbortRequest, DetokenizeReply, DetokenizeRequest, GatewayInbound, GenerateChunk,
                             GenerateError, GenerateRequest, MetricsReply, MetricsRequest, SchedulerReply, StatusReply,
                             StatusRequest, TokenizeReply, TokenizeRequest, TokenizerPing, TokenizerPong)

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
METRICS_MIN_VERSION = 3  # the protocol version that brought MetricsRequest


class Gateway(Actor):
    name = "gateway"

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__()
        self.config = config
        self.metrics = GatewayMetrics(self.loop_lag)
        self._identity = f"gateway-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self._api_keys = [key.encode() for key in config.api_key_list]
        self._calls: dict[str, Call] = {}
        self._num_in_flight = 0
        self._is_draining = False
        self._status: StatusReply | None = None
        self._status_at = -math.inf
        self._status_poll: asyncio.Future[StatusReply] | None = None
        self._status_poll_at = -math.inf
        self._metrics_polls: dict[str, asyncio.Future[bytes]] = {}  # MetricsRequest id → the scheduler's text
        self._tokenizer_polls: dict[str, asyncio.Future[Any]] = {}  # (De)TokenizeRequest id → the reply
        self._watch = TokenizerWatch(len(config.tokenizer_addr_list), config.tokenizer_silent_s)
        self._sent_at: dict[str, float] = {}  # generations sent to a tokenizer and not ended → when (loop time)
        # generations of _sent_at → their samples whose last chunk has not arrived: a generation ends for the watch
        # when its last sample's does, not when its HTTP call does (a call of several prompts outlives each one, and
        # a tokenizer rightly stops holding a finished one)
        self._open_samples: dict[str, int] = {}
        self._created_s = int(time.time())
        self._runner: web.AppRunner | None = None
        self._tokenizers: zmq.asyncio.Socket | None = None
        self._schedulers: zmq.asyncio.Socket | None = None

    async def start(self) -> None:
        self._tokenizers = _dealer(self.config.tokenizer_addr_list, self._identity)
        self._schedulers = _dealer(self.config.scheduler_addr_list, self._identity)
        self.spawn(transport.receive_forever(self._tokenizers, GatewayInbound, self._on_result), "tokenizer-recv")
        self.spawn(transport.receive_forever(self._schedulers, SchedulerReply, self._on_scheduler_reply),
                   "scheduler-recv")
        if self.config.tokenizer_ping_s > 0:
            self.every(self.config.tokenizer_ping_s, self._ping_tokenizers, "tokenizer-ping")
        # NOTE: bodies are decoded by decode_body, so an encoding aiohttp cannot read fails in our handler
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, shutdown_timeout=5.0,
                                     access_log=None, auto_decompress=False, logger=_ONE_LINE_SERVER_LOG)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        log.info("listening", host=self.config.host, port=self.config.port, identity=self._identity.decode(),
                 auth=bool(self._api_keys))

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for sock in (self._tokenizers, self._schedulers):
            if sock is not None:
                sock.close(linger=0)

    async def drain(self) -> None:
        """Refuse new generations (503) and wait up to drain_timeout_s for those in flight; then fail and abort
        what is left, so no client is left without an answer."""
        self._is_draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        log.info("draining", num_in_flight=self._num_in_flight, timeout_s=self.config.drain_timeout_s)
        while self._num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self._calls:
            return
        calls = set(self._calls.values())
        log.warning("drain timeout; failing the requests left", num_requests=len(calls))
        for call in calls:
            for request_id in call.open_request_ids():
                await self._abort(request_id, "shutdown")
            call.failed.update(range(len(call.request_ids)))  # NOTE: aborted above; the call's end aborts none again
            call.queue.put_nowait(GenerateError(call.request_ids[0], 503, "server_error",
                                                "The server shut down before the request finished."))
        deadline = loop.time() + 2.0
        while self._num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._error_middleware, self._auth_middleware])
        app.router.add_post(CHAT_PATH, self.chat_completions)
        app.router.add_post(COMPLETIONS_PATH, self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.retrieve_model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    # --- middlewares ---

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error becomes OpenAI-shaped JSON; every response is counted by endpoint and status."""
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:
            response = error_response(self._http_error(request, exc))
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except Exception:  # noqa: BLE001 - a handler bug answers 500, never a bare traceback page
            log.exception("handler failed", path=request.path)
            response = error_response(ApiError(500, "The server had an error while processing your request.",
                                               type="server_error"))
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._api_keys and request.path != "/health":  # NOTE: /metrics and unknown paths too
            check_bearer(request.headers.get("Authorization"), self._api_keys)
        return await handler(request)

    def _http_error(self, request: web.Request, exc: web.HTTPException) -> ApiError:
        if exc.status == 404:
            return ApiError(404, f"Invalid URL ({request.method} {request.path})", code="unknown_url")
        if exc.status == 405:
            return ApiError(405, f"Method {request.method} is not allowed for {request.path}.",
                            code="method_not_allowed")
        if exc.status == 413:
            return ApiError(413, f"Request body too large: the limit is {self.config.max_body_bytes} bytes.",
                            code="request_too_large")
        return ApiError(exc.status, exc.reason)

    # --- routes ---

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def list_models(self, request: web.Request) -> web.Response:
        data = [self._model_card(m) for m in await self._model_ids(allow_empty=True)]
        return json_response({"object": "list", "data": data})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model not in await self._model_ids(allow_empty=True):
            raise model_not_found(model)
        return json_response(self._model_card(model))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids of a prompt or of chat messages (as a generation would run them)."""
        body = await self._json_body(request)
        msg = parse_tokenize_request(body, request_id=f"tokenize-{uuid.uuid4().hex}")
        await self._check_optional_model(body)
        reply: TokenizeReply = await self._ask_tokenizer(msg)
        return json_response({"count": len(reply.token_ids), "max_model_len": reply.max_model_len or None,
                              "tokens": reply.token_ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        body = await self._json_body(request)
        msg = parse_detokenize_request(body, request_id=f"detokenize-{uuid.uuid4().hex}")
        await self._check_optional_model(body)
        reply: DetokenizeReply = await self._ask_tokenizer(msg)
        return json_response({"prompt": reply.text})

    async def health(self, request: web.Request) -> web.Response:
        if self._is_draining:
            raise ApiError(503, "The server is shutting down.", type="server_error", code="service_unavailable")
        status = await self._scheduler_status()
        if status is None:
            raise ApiError(503, "No scheduler answered a status request.", type="server_error",
                           code="service_unavailable")
        if status.num_workers < 1:
            raise ApiError(503, "No live worker.", type="server_error", code="service_unavailable")
        return json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.Response:
        """The gateway's series, then one scheduler's (its own and every live worker's engine series)."""
        scheduler_text = await self._scheduler_metrics()
        self.metrics.scheduler_metrics_up.set(0 if scheduler_text is None else 1)
        return web.Response(body=self.metrics.render() + (scheduler_text or b""), content_type="text/plain",
                            charset="utf-8")

    # --- generation ---

    async def _generate(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        started = time.monotonic()
        if self._is_draining:
            raise ApiError(503, "The server is shutting down; please retry on another replica.", type="server_error",
                           code="service_unavailable", retry_after_s=1.0)
        if self._num_in_flight >= self.config.max_concurrent_requests:
            raise ApiError(429, "Too many concurrent requests; please retry shortly.", type="rate_limit_error",
                           code="rate_limit_exceeded", retry_after_s=1.0)
        self._num_in_flight += 1
        self.metrics.in_flight.inc()
        try:
            parsed = await self._parse(request, is_chat)
            return await self._serve(request, parsed, started)
        finally:
            self._num_in_flight -= 1
            self.metrics.in_flight.dec()

    async def _json_body(self, request: web.Request) -> Any:
        """The request's JSON body, its Content-Encoding undone; ApiError (logged in one line) when unreadable."""
        try:
            raw = decode_body(await request.read(), request.headers.get("Content-Encoding"),
                              self.config.max_body_bytes)
        except (RequestPayloadError, HttpProcessingError) as exc:  # e.g. a body cut short
            raise ApiError(400, f"We could not read the body of your request: {str(exc).strip()[:200]}",
                           code="invalid_body") from None
        except ApiError as exc:
            log.info("unreadable request body", path=request.path, status=exc.status, code=exc.code,
                     content_encoding=request.headers.get("Content-Encoding", "")[:40])
            raise
        return parse_json_body(raw)

    async def _check_optional_model(self, body: dict) -> None:
        if body.get("model") is not None:
            check_model(body["model"], await self._model_ids(allow_empty=False))

    async def _parse(self, request: web.Request, is_chat: bool) -> ParsedRequest:
        body = await self._json_body(request)
        model_ids = await self._model_ids(allow_empty=False)
        timeout_s = self.config.request_timeout_s
        deadline_s = time.time() + timeout_s if timeout_s else None
        if is_chat:
            return parse_chat_request(body, request_id=f"chatcmpl-{uuid.uuid4().hex}", model_ids=model_ids,
                                      default_max_tokens=self.config.default_chat_max_tokens, deadline_s=deadline_s,
                                      tool_call_parser=self.config.tool_call_parser)
        return parse_completion_request(body, request_id=f"cmpl-{uuid.uuid4().hex}", model_ids=model_ids,
                                        deadline_s=deadline_s)

    async def _serve(self, request: web.Request, parsed: ParsedRequest, started: float) -> web.StreamResponse:
        """Send one generation per prompt and answer the call from their chunks; the failure of any fails the call,
        and whatever is still running upstream when the call ends is aborted."""
        timeout_s = self.config.request_timeout_s
        call = Call([g.request_id for g in parsed.generates], asyncio.Queue(),
                    RequestOutput(parsed.n, len(parsed.generates)),
                    asyncio.get_running_loop().time() + timeout_s if timeout_s else math.inf, timeout_s)
        self._calls.update(dict.fromkeys(call.request_ids, call))
        reason = "client_disconnected"
        try:
            if parsed.is_echo:
                await self._echo(parsed.generates, call.output)
            for generate in parsed.generates:
                await self._send(self._tokenizers, generate, "tokenizer")
                self._sent_at[generate.request_id] = asyncio.get_running_loop().time()
                self._open_samples[generate.request_id] = generate.sampling.n
                call.num_sent += 1
            first = await call.next_chunk()
            self.metrics.ttft.labels(request.path).observe(time.monotonic() - started)
            if parsed.is_stream:
                response = await self._stream(request, parsed, call, first)
            else:
                response = await self._whole(parsed, call)
            self._record_finished(request.path, call, started)
            return response
        except ApiError as exc:
            reason = exc.code or "error"
            raise
        finally:
            for request_id in call.request_ids:
                del self._calls[request_id]
                self._generation_ended(request_id)
            for request_id in call.open_request_ids():
                await self._abort(request_id, reason)

    async def _echo(self, generates: tuple[GenerateRequest, ...], output: RequestOutput) -> None:
        """Each choice's text starts with its prompt: a text as sent, token ids as the tokenizer decodes them."""
        async def text(generate: GenerateRequest) -> str:
            if generate.prompt_text is not None:
                return generate.prompt_text
            msg = DetokenizeRequest(f"echo-{uuid.uuid4().hex}", generate.prompt_token_ids or [])
            return (await self._ask_tokenizer(msg)).text

        for prompt, prompt_text in enumerate(await asyncio.gather(*map(text, generates))):
            output.echo(prompt, prompt_text)

    async def _whole(self, parsed: ParsedRequest, call: Call) -> web.Response:
        while not call.output.is_finished:
            await call.next_chunk()
        created = int(time.time())
        if parsed.is_chat:
            return json_response(chat_response(parsed.request_id, parsed.model, created, call.output,
                                               parsed.has_logprobs, parsed.tool_policy, self.config.tool_call_parser,
                                               parsed.has_prompt_logprobs))
        return json_response(completion_response(parsed.request_id, parsed.model, created, call.output,
                                                 parsed.has_logprobs, parsed.has_prompt_logprobs))

    async def _stream(self, request: web.Request, parsed: ParsedRequest, call: Call,
                      first: GenerateChunk) -> web.StreamResponse:
        """SSE: role chunks (chat), one event per GenerateChunk, the usage chunk, [DONE]; errors as events."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        created = int(time.time())
        try:
            try:
                await self._stream_events(response, parsed, call, first, created)
            except ApiError as exc:  # the stream ends as every stream does: the error event, then [DONE]
                await write_event(response, exc.body())
                await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            log.info("client disconnected mid-stream", request_id=parsed.request_id)
        return response

    async def _stream_events(self, response: web.StreamResponse, parsed: ParsedRequest, call: Call,
                             first: GenerateChunk, created: int) -> None:
        rid, model, usage = parsed.request_id, parsed.model, parsed.include_usage
        if parsed.is_chat:
            for index in range(parsed.n):
                await write_event(response, chat_role_chunk(rid, model, created, index, usage))
        # with logprobs a choice's echo waits for its first chunk, which brings the prompt's logprobs
        unechoed = set(range(len(call.output.echoes))) if parsed.has_logprobs else set()
        for index, echo in enumerate(call.output.echoes):
            if index not in unechoed:
                await write_event(response, echo_chunk(rid, model, created, index, echo, None, usage))
        tools = None if parsed.tool_policy is None else ToolCallStream(parsed.tool_policy, parsed.n,
                                                                        self.config.tool_call_parser)
        chunk = first
        while True:
            if tools is not None:
                bodies = tools.chat_chunks(rid, model, created, chunk, parsed.has_logprobs, usage,
                                           parsed.has_prompt_logprobs)
            elif parsed.is_chat:
                bodies = [chat_chunk(rid, model, created, chunk, parsed.has_logprobs, usage,
                                     parsed.has_prompt_logprobs)]
            else:
                offset = len(call.output.samples[chunk.index].text) - len(chunk.text)
                bodies = [completion_chunk(rid, model, created, chunk, parsed.has_logprobs, offset, usage,
                                           parsed.has_prompt_logprobs)]
                if chunk.index in unechoed:
                    unechoed.discard(chunk.index)
                    echo = call.output.echoes[chunk.index]
                    bodies.insert(0, echo_chunk(rid, model, created, chunk.index, echo, chunk, usage))
            for body in bodies:
                await write_event(response, body)
            if call.output.is_finished:
                break
            chunk = await call.next_chunk()
        if usage:
            object_ = "chat.completion.chunk" if parsed.is_chat else "text_completion"
            await write_event(response, usage_chunk(rid, object_, model, created, call.output))
        await response.write(b"data: [DONE]\n\n")

    def _record_finished(self, endpoint: str, call: Call, started: float) -> None:
        if not call.output.is_finished:
            return
        self.metrics.e2e.labels(endpoint).observe(time.monotonic() - started)
        self.metrics.prompt_tokens.inc(call.output.num_prompt_tokens)
        self.metrics.cached_tokens.inc(call.output.num_cached_tokens)
        self.metrics.completion_tokens.inc(call.output.num_completion_tokens)

    # --- ZeroMQ peers ---

    async def _ping_tokenizers(self) -> None:
        """Ask the next tokenizer what it holds; fail the generations that no tokenizer holds any more."""
        now = asyncio.get_running_loop().time()
        try:
            await self._send(self._tokenizers, TokenizerPing(now), "tokenizer")
        except ApiError:
            pass  # none connected: nothing to learn, nothing declared lost
        for request_id in self._watch.lost(self._sent_at, now):
            self._generation_ended(request_id)
            call = self._calls.get(request_id)
            if call is not None:
                log.warning("tokenizer holding the request was lost", request_id=request_id)
                call.queue.put_nowait(GenerateError(request_id, 503, "server_error",
                                                    "The tokenizer holding the request stopped or restarted; "
                                                    "please retry.", error_code="tokenizer_lost", retry_after_s=1.0))

    async def _on_result(self, msg: GenerateChunk | GenerateError | TokenizeReply | DetokenizeReply | TokenizerPong,
                         _identity: bytes | None) -> None:
        if isinstance(msg, TokenizerPong):
            if self._watch.on_pong(msg.name, msg.incarnation, msg.sent_at, msg.request_ids,
                                   asyncio.get_running_loop().time()):
                log.warning("tokenizer restarted", tokenizer=msg.name)
            return
        future = self._tokenizer_polls.get(msg.request_id)
        if future is not None:
            if future.done():
                return
            if isinstance(msg, GenerateError):
                future.set_exception(api_error(msg))
            else:
                future.set_result(msg)
            return
        if isinstance(msg, (TokenizeReply, DetokenizeReply)):
            log.debug("reply for a request no longer waited for", request_id=msg.request_id)
            return
        call = self._calls.get(msg.request_id)
        if call is None:
            log.debug("result for an unknown request", request_id=msg.request_id)
            return
        if isinstance(msg, GenerateError) or msg.finish_reason is not None:
            self._on_sample_ended(msg.request_id, isinstance(msg, GenerateError))
        call.queue.put_nowait(msg)

    def _on_sample_ended(self, request_id: str, is_error: bool) -> None:
        """A sample's last chunk (or the generation's error) arrived: once none is left, the tokenizer holds the
        generation no more, and the watch must not count it as lost."""
        left = self._open_samples.get(request_id)
        if left is None:
            return
        if is_error or left <= 1:
            self._generation_ended(request_id)
        else:
            self._open_samples[request_id] = left - 1

    def _generation_ended(self, request_id: str) -> None:
        self._sent_at.pop(request_id, None)
        self._open_samples.pop(request_id, None)

    async def _ask_tokenizer(self, msg: TokenizeRequest | DetokenizeRequest) -> Any:
        """A tokenizer's TokenizeReply or DetokenizeReply to msg; ApiError for its error, 503 when none answers."""
        self._tokenizer_polls[msg.request_id] = asyncio.get_running_loop().create_future()
        try:
            await self._send(self._tokenizers, msg, "tokenizer")
            return await asyncio.wait_for(self._tokenizer_polls[msg.request_id], self.config.tokenize_timeout_s)
        except TimeoutError:
            raise ApiError(503, f"No tokenizer answered within {self.config.tokenize_timeout_s:g} s.",
                           type="server_error", code="service_unavailable") from None
        finally:
            del self._tokenizer_polls[msg.request_id]

    async def _on_scheduler_reply(self, msg: StatusReply | MetricsReply, identity: bytes | None) -> None:
        if isinstance(msg, StatusReply):
            await self._on_status(msg, identity)
            return
        future = self._metrics_polls.get(msg.request_id)
        if future is not None and not future.done():
            future.set_result(msg.text)

    async def _scheduler_metrics(self) -> bytes | None:
        """The Prometheus text of one scheduler (the DEALER's next one: every scheduler hears every worker's
        heartbeats); None when no scheduler that knows MetricsRequest answers within peer_timeout_s."""
        status = await self._scheduler_status()
        if status is None or status.version < METRICS_MIN_VERSION:
            return None
        request_id = uuid.uuid4().hex
        self._metrics_polls[request_id] = asyncio.get_running_loop().create_future()
        try:
            await self._send(self._schedulers, MetricsRequest(request_id), "scheduler")
            return await asyncio.wait_for(self._metrics_polls[request_id], self.config.peer_timeout_s)
        except (ApiError, TimeoutError):
            return None
        finally:
            del self._metrics_polls[request_id]

    async def _on_status(self, msg: StatusReply, _identity: bytes | None) -> None:
        self._status, self._status_at = msg, asyncio.get_running_loop().time()
        if self._status_poll is not None and not self._status_poll.done():
            self._status_poll.set_result(msg)

    async def _scheduler_status(self) -> StatusReply | None:
        """The schedulers' latest StatusReply (cached status_cache_s); None when none answers in time."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._status is not None and now - self._status_at < self.config.status_cache_s:
            return self._status
        timeout_s = self.config.peer_timeout_s
        if self._status_poll is None or self._status_poll.done() or now - self._status_poll_at > timeout_s:
            self._status_poll, self._status_poll_at = loop.create_future(), now
            try:
                await self._send(self._schedulers, StatusRequest(), "scheduler")
            except ApiError:
                return None
        try:
            return await asyncio.wait_for(asyncio.shield(self._status_poll), timeout_s)
        except TimeoutError:
            return None

    async def _model_ids(self, allow_empty: bool) -> list[str]:
        if self.config.model_id:
            return [self.config.model_id]
        status = await self._scheduler_status()
        if status is None:
            raise ApiError(503, "No scheduler answered a status request; the server is not ready.",
                           type="server_error", code="service_unavailable")
        if not status.model_ids and not allow_empty:
            raise ApiError(503, "No model is being served yet (no live worker).", type="server_error",
                           code="service_unavailable")
        return list(dict.fromkeys(status.model_ids))

    async def _send(self, sock: zmq.asyncio.Socket | None, msg: msgspec.Struct, peer: str) -> None:
        try:
            await asyncio.wait_for(transport.send(sock, msg), self.config.peer_timeout_s)
        except TimeoutError:
            raise ApiError(503, f"No {peer} is reachable.", type="server_error",
                           code="service_unavailable") from None

    async def _abort(self, request_id: str, reason: str) -> None:
        try:
            await asyncio.shield(self._send(self._tokenizers, AbortRequest(request_id, reason), "tokenizer"))
        except (ApiError, asyncio.CancelledError):
            log.warning("could not send abort", request_id=request_id, reason=reason)
        else:
            log.info("aborted", request_id=request_id, reason=reason)

    def _model_card(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self._created_s, "owned_by": "radixserve"}


class _OneLineServerLog:
    """aiohttp's server logger: what it reports itself (an unparsable request, a failed write) as one line each,
    without the traceback it would log, so no unauthenticated request can flood the log with tracebacks."""

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass

    def exception(self, message: str, *args: Any, exc_info: BaseException | None = None, **_: Any) -> None:
        log.warning("http server error", detail=(message % args)[:200], error=repr(exc_info)[:300])

    warning = error = exception


_ONE_LINE_SERVER_LOG = _OneLineServerLog()


def check_bearer(header: str | None, api_keys: list[bytes]) -> None:
    """Raise 401 unless header is `Bearer <key>` for one of api_keys (constant-time compare against each)."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "You didn't provide an API key. You need to provide your API key in an "
                            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                       code="missing_api_key")
    # NOTE: both sides hashed to 32 bytes, so the comparison's time depends on neither key's length or bytes.
    given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
    if not any([hmac.compare_digest(given, hashlib.sha256(key).digest()) for key in api_keys]):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers,
                        content_type="application/json")


def error_response(exc: ApiError) -> web.Response:
    headers = dict(exc.headers)
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return json_response(exc.body(), exc.status, headers)


async def write_event(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + msgspec.json.encode(body) + b"\n\n")


def _dealer(addrs: list[str], identity: bytes) -> zmq.asyncio.Socket:
    """One DEALER connected to every addr; IMMEDIATE, so requests only go to peers that are connected."""
    sock = transport.context().socket(zmq.DEALER)
    for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, transport.MAX_FRAME_BYTES), (zmq.IDENTITY, identity),
                          (zmq.SNDHWM, 100_000), (zmq.IMMEDIATE, 1)):
        sock.setsockopt(option, value)
    for addr in addrs:
        sock.connect(addr)
    return sock
