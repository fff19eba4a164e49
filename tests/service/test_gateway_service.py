"""The gateway as a real process over ipc://, with a scripted fake tokenizer and a fake scheduler."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import zmq
import zmq.asyncio

from shared.messages import (AbortRequest, DetokenizeReply, DetokenizeRequest, GenerateChunk, GenerateError,
                             GenerateRequest, MetricsReply, MetricsRequest, StatusReply, StatusRequest, TokenizeReply,
                             TokenizeRequest, TokenizerInbound, TokenizerPing, TokenizerPong, TokenLogprobEntry, decode,
                             encode)
from shared.sampling import context_length_error

REPO = Path(__file__).resolve().parents[2]
MODEL = "fake-model"
PIECES = ["Hel", "lo", " #{i}"]  # every sample's text, one GenerateChunk per piece
NUM_PROMPT_TOKENS, NUM_CACHED_TOKENS = 4, 2
SCHEDULER_METRICS = (b'# TYPE radixserve_num_requests_running gauge\n'
                     b'radixserve_num_requests_running{worker_id="w0"} 2.0\n')


class FakePeers:
    """A tokenizer ROUTER answering GenerateRequests by script, and a scheduler ROUTER answering StatusRequests
    and (while answers_metrics) MetricsRequests with SCHEDULER_METRICS.

    Script, by the prompt text (the last chat message or the completion prompt):
      anything: each sample i streams "Hel", "lo", " #i" (tokens 10, 11, 12+i), finish "length" if
                max_tokens <= 3 else "stop"; logprobs of each token -0.5 with alternatives (99, -2.0)
      "slow":   the first piece of each sample, then nothing (until an AbortRequest)
      "error429" / "midstream": GenerateError(429) at once / after the first pieces, GenerateError(500)
      "toolong": GenerateError(400, context_length_exceeded) at once, as a worker with an 8192-token context
    TokenizeRequest: a text's ids are its characters' code points (a chat's: its last message's), max 8192;
    DetokenizeRequest: the characters of those code points, or GenerateError(400) for id 0.
    TokenizerPing: unanswered, unless pong_incarnation is set: then a TokenizerPong holding the "slow" requests not
    aborted (`held`), as incarnation pong_incarnation.
    """

    def __init__(self, tmp_dir: str) -> None:
        self.tokenizer_addr = f"ipc://{tmp_dir}/tok"
        self.scheduler_addr = f"ipc://{tmp_dir}/sched"
        self.requests: list[GenerateRequest] = []
        self.aborts: list[AbortRequest] = []
        self.held: set[str] = set()
        self.pong_incarnation: str | None = None
        self.num_workers = 1
        self.answers_metrics = True
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(5)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        ctx = zmq.asyncio.Context()
        tokenizer, scheduler = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        tokenizer.bind(self.tokenizer_addr)
        scheduler.bind(self.scheduler_addr)
        self._loop.create_task(self._serve_tokenizer(tokenizer))
        self._loop.create_task(self._serve_scheduler(scheduler))
        self._ready.set()
        self._loop.run_forever()
        ctx.destroy(linger=0)

    async def _serve_scheduler(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            identity, data = await sock.recv_multipart()
            request = decode(data, StatusRequest | MetricsRequest)
            if isinstance(request, MetricsRequest):
                if self.answers_metrics:
                    await sock.send_multipart([identity, encode(MetricsReply(request.request_id, SCHEDULER_METRICS))])
                continue
            reply = StatusReply([MODEL] if self.num_workers else [], self.num_workers, 0, 0)
            await sock.send_multipart([identity, encode(reply)])

    async def _serve_tokenizer(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            identity, data = await sock.recv_multipart()
            msg = decode(data, TokenizerInbound)
            if isinstance(msg, AbortRequest):
                self.aborts.append(msg)
                self.held.discard(msg.request_id)
                continue
            if isinstance(msg, TokenizerPing):
                if self.pong_incarnation is not None:
                    pong = TokenizerPong(self.tokenizer_addr, self.pong_incarnation, msg.sent_at, sorted(self.held))
                    await sock.send_multipart([identity, encode(pong)])
                continue
            if isinstance(msg, (TokenizeRequest, DetokenizeRequest)):
                await sock.send_multipart([identity, encode(_tokenizer_reply(msg))])
                continue
            if (msg.messages[-1].content if msg.messages else msg.prompt_text) == "slow":
                self.held.add(msg.request_id)
            self.requests.append(msg)
            for reply in self._script(msg):
                await sock.send_multipart([identity, encode(reply)])
                await asyncio.sleep(0.001)

    def _script(self, req: GenerateRequest) -> list[GenerateChunk | GenerateError]:
        prompt = req.messages[-1].content if req.messages else req.prompt_text
        if prompt == "error429":
            return [GenerateError(req.request_id, 429, "rate_limit_error", "queue full", retry_after_s=2.5)]
        if prompt == "toolong":  # as a worker with an 8192-token context answers
            exc = context_length_error(8192, NUM_PROMPT_TOKENS, req.sampling.max_tokens)
            return [GenerateError(req.request_id, 400, "invalid_request_error", exc.message, error_code=exc.code,
                                  param=exc.param)]
        n = req.sampling.n
        num_pieces = {"slow": 1, "midstream": 1}.get(prompt, len(PIECES))
        out: list[GenerateChunk | GenerateError] = [
            _piece(req, i, k) for k in range(num_pieces) for i in range(n)]
        if prompt == "midstream":
            out.append(GenerateError(req.request_id, 500, "server_error", "worker died"))
        return out


def _tokenizer_reply(msg: TokenizeRequest | DetokenizeRequest) -> TokenizeReply | DetokenizeReply | GenerateError:
    if isinstance(msg, TokenizeRequest):
        text = msg.messages[-1].content if msg.messages else msg.prompt_text or ""
        return TokenizeReply(msg.request_id, [ord(c) for c in text], 8192)
    if 0 in msg.token_ids:
        return GenerateError(msg.request_id, 400, "invalid_request_error", "token id 0 is not allowed")
    return DetokenizeReply(msg.request_id, "".join(map(chr, msg.token_ids)))


def _piece(req: GenerateRequest, index: int, k: int) -> GenerateChunk:
    text = PIECES[k].format(i=index)
    token_id = 10 + k + (index if k == 2 else 0)
    is_last = k == len(PIECES) - 1
    logprobs = None
    if req.sampling.logprobs is not None:
        logprobs = [TokenLogprobEntry(token_id, -0.5, [(token_id, -0.5), (99, -2.0)][:req.sampling.logprobs])]
    finish = ("length" if req.sampling.max_tokens <= 3 else "stop") if is_last else None
    return GenerateChunk(req.request_id, index, text, [token_id], logprobs, [text], finish, NUM_PROMPT_TOKENS,
                         NUM_CACHED_TOKENS)


class GatewayProcess:
    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.gateway", "--host", "127.0.0.1",
                                      "--port", str(self.port), *args], cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**os.environ, "RADIXSERVE_LOG_JSON": "1"})
        self._wait_ready(log_path)

    def _wait_ready(self, log_path: Path) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log_path.read_text()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("gateway did not start: " + log_path.read_text())

    def stop(self) -> int:
        """SIGTERM; the exit code. Fails when the gateway logged an error (a hidden handler exception)."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(15)
        self._log.close()
        errors = [line for line in self.log_path.read_text().splitlines() if '"level": "error"' in line]
        assert errors == []
        return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tmp_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="gw") as path:
        yield path


@pytest.fixture(scope="module")
def peers(tmp_dir: str) -> Iterator[FakePeers]:
    fake = FakePeers(tmp_dir)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def gateway(peers: FakePeers, tmp_dir: str) -> Iterator[GatewayProcess]:
    """Open gateway; the model id is learned from the fake scheduler."""
    gw = GatewayProcess(["--tokenizer-addrs", peers.tokenizer_addr, "--scheduler-addrs", peers.scheduler_addr],
                        Path(tmp_dir) / "gateway.log")
    yield gw
    assert gw.stop() == 0


@pytest.fixture(scope="module")
def strict_gateway(peers: FakePeers, tmp_dir: str) -> Iterator[GatewayProcess]:
    """Keys k1,k2; fixed model id; no scheduler at all; 1.5 s timeout; one request at a time; 64 KiB bodies."""
    gw = GatewayProcess(["--tokenizer-addrs", peers.tokenizer_addr, "--scheduler-addrs", f"ipc://{tmp_dir}/none",
                         "--api-keys", "k1,k2", "--model-id", MODEL, "--request-timeout-s", "1.5",
                         "--peer-timeout-s", "0.5", "--max-concurrent-requests", "1", "--max-body-bytes", "65536"],
                        Path(tmp_dir) / "strict.log")
    yield gw
    assert gw.stop() == 0


def client(gw: GatewayProcess, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def post(gw: GatewayProcess, path: str, body: Any = None, data: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, dict, Any]:
    async with aiohttp.ClientSession() as session:
        payload = data if data is not None else json.dumps(body).encode()
        async with session.post(gw.url + path, data=payload, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def get(gw: GatewayProcess, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + path, headers=headers) as resp:
            return resp.status, await resp.text()


async def wait_for(condition: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": NUM_PROMPT_TOKENS, "completion_tokens": 3, "total_tokens": NUM_PROMPT_TOKENS + 3,
         "prompt_tokens_details": {"cached_tokens": NUM_CACHED_TOKENS}}


# --- the openai SDK ---

@pytest.mark.asyncio
async def test_sdk_chat_n2_and_sampling_mapping(gateway: GatewayProcess, peers: FakePeers) -> None:
    reply = await client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], n=2,
        temperature=0.3, max_completion_tokens=50, stop=["\n"], seed=7, extra_body={"top_k": 5, "min_p": 0.05})
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in reply.choices] == [
        (0, "assistant", "Hello #0", "stop"), (1, "assistant", "Hello #1", "stop")]
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == MODEL
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (4, 6, 10)
    assert reply.usage.prompt_tokens_details.cached_tokens == 2
    sent = peers.requests[-1]
    assert sent.request_id == reply.id
    assert (sent.sampling.n, sent.sampling.temperature, sent.sampling.max_tokens, sent.sampling.seed,
            sent.sampling.top_k, sent.sampling.min_p, sent.stop) == (2, 0.3, 50, 7, 5, 0.05, ["\n"])
    assert [(m.role, m.content) for m in sent.messages] == [("system", "s"), ("user", "hi")]


@pytest.mark.asyncio
async def test_sdk_chat_logprobs(gateway: GatewayProcess) -> None:
    reply = await client(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                          logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("Hel", -0.5, list(b"Hel")),
                                                                 ("lo", -0.5, list(b"lo")),
                                                                 (" #0", -0.5, list(b" #0"))]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hel", -0.5), ("token_id:99", -2.0)]


@pytest.mark.asyncio
async def test_sdk_chat_stream_with_usage(gateway: GatewayProcess) -> None:
    stream = await client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, stream=True,
        stream_options={"include_usage": True})
    texts, roles, finishes, usages = ["", ""], set(), {}, []
    async for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
            assert chunk.choices == []
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles.add(choice.delta.role)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == ["Hello #0", "Hello #1"]
    assert roles == {"assistant", None}
    assert finishes == {0: "stop", 1: "stop"}
    assert [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in usages] == [(4, 6, 10)]


@pytest.mark.asyncio
async def test_sdk_completion_whole_and_logprobs(gateway: GatewayProcess, peers: FakePeers) -> None:
    reply = await client(gateway).completions.create(model=MODEL, prompt="hello", max_tokens=3, logprobs=1)
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason, reply.object) == ("Hello #0", "length", "text_completion")
    assert choice.logprobs.tokens == ["Hel", "lo", " #0"]
    assert choice.logprobs.token_logprobs == [-0.5, -0.5, -0.5]
    assert choice.logprobs.text_offset == [0, 3, 5]
    assert choice.logprobs.top_logprobs == [{"Hel": -0.5}, {"lo": -0.5}, {" #0": -0.5}]
    assert reply.usage.model_dump(exclude_none=True) == USAGE
    assert (peers.requests[-1].prompt_text, peers.requests[-1].sampling.logprobs) == ("hello", 1)


@pytest.mark.asyncio
async def test_sdk_completion_default_max_tokens_and_token_prompt(gateway: GatewayProcess,
                                                                  peers: FakePeers) -> None:
    await client(gateway).completions.create(model=MODEL, prompt=[1, 2, 3])
    assert (peers.requests[-1].prompt_token_ids, peers.requests[-1].sampling.max_tokens) == ([1, 2, 3], 16)
    await client(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert peers.requests[-1].sampling.max_tokens == 1024


@pytest.mark.asyncio
async def test_sdk_completion_stream(gateway: GatewayProcess) -> None:
    stream = await client(gateway).completions.create(model=MODEL, prompt="hello", stream=True, logprobs=0)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "Hello #0"
    assert [c.choices[0].logprobs.text_offset for c in chunks] == [[0], [3], [5]]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "stop"]


@pytest.mark.asyncio
async def test_sdk_errors(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client(gateway).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.APIError, match="worker died"):
        stream = await client(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "midstream"}], stream=True)
        async for _ in stream:
            pass


@pytest.mark.asyncio
async def test_an_error_mid_stream_is_a_coded_event_then_done(gateway: GatewayProcess) -> None:
    """Issue 31, item 4: a worker lost mid-stream ended the stream with an error event whose code was null and no
    [DONE]; now the event carries a code from its status and the stream ends as every stream does."""
    async with aiohttp.ClientSession() as session:
        async with session.post(gateway.url + "/v1/completions",
                                json={"model": MODEL, "prompt": "midstream", "stream": True}) as resp:
            assert resp.status == 200
            events = [line.removeprefix("data: ") for line in (await resp.text()).splitlines()
                      if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["message"], error["type"], error["code"]) == ("worker died", "server_error", "internal_error")


@pytest.mark.asyncio
async def test_a_stream_whose_tokenizer_restarts_ends_with_tokenizer_lost(gateway: GatewayProcess,
                                                                          peers: FakePeers) -> None:
    """Issue 31, item 4: a killed tokenizer froze its streams (the gateway waited for chunks nobody would send). The
    gateway asks the tokenizers what they hold; a stream stays open while its tokenizer holds it, and ends with a
    coded error and [DONE] once the tokenizer answers as a new incarnation that holds nothing."""
    peers.pong_incarnation = "first"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": "slow", "stream": True}) as resp:
                first = await resp.content.readline()
                assert first.startswith(b"data: ") and b"Hel" in first
                with pytest.raises(TimeoutError):  # held: pings go on, and the stream stays open
                    await asyncio.wait_for(resp.content.readuntil(b"[DONE]"), 1.5)
                peers.held.clear()
                peers.pong_incarnation = "second"  # restarted: holds nothing
                rest = (await asyncio.wait_for(resp.content.read(), 10)).decode()
    finally:
        peers.pong_incarnation = None
    events = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "tokenizer_lost"


@pytest.mark.asyncio
async def test_a_finished_prompt_of_a_call_still_running_is_not_declared_lost(gateway: GatewayProcess,
                                                                             peers: FakePeers) -> None:
    """CI caught an echo call of two prompts ending in 503 tokenizer_lost: the first prompt's generation had finished
    (its tokenizer rightly no longer held it) while the call waited for the second, and the watch still counted the
    first as sent and not ended. A generation ends for the watch with its last sample's chunk."""
    peers.pong_incarnation = "first"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": ["quick", "slow"], "stream": True}) as resp:
                assert resp.status == 200
                with pytest.raises(TimeoutError):  # pings answered holding only "slow": nothing is lost
                    await asyncio.wait_for(resp.content.readuntil(b"[DONE]"), 2.0)
    finally:
        peers.pong_incarnation = None


@pytest.mark.asyncio
async def test_sdk_models(gateway: GatewayProcess) -> None:
    models = await client(gateway).models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model", "radixserve")]
    assert (await client(gateway).models.retrieve(MODEL)).id == MODEL


# --- raw HTTP ---

@pytest.mark.asyncio
async def test_malformed_json(gateway: GatewayProcess) -> None:
    status, _, body = await post(gateway, "/v1/chat/completions", data=b'{"model": ')
    assert status == 400
    assert body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.asyncio
@pytest.mark.parametrize("extra, param, fragment", [
    ({"foo": 1}, None, "Unrecognized request argument supplied: foo"),
    ({"temperature": 3}, "temperature", "decimal above maximum value"),
    ({"n": 17}, "n", "integer above maximum value"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools' are specified"),
])
async def test_bad_bodies(gateway: GatewayProcess, extra: dict, param: str | None, fragment: str) -> None:
    status, _, body = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
    assert (status, body["error"]["param"]) == (400, param)
    assert fragment in body["error"]["message"]


@pytest.mark.asyncio
async def test_unknown_model_404(gateway: GatewayProcess) -> None:
    status, _, body = await post(gateway, "/v1/completions", {"model": "gpt-x", "prompt": "a"})
    assert (status, body) == (404, {"error": {
        "message": "The model `gpt-x` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": None, "code": "model_not_found"}})


@pytest.mark.asyncio
async def test_unknown_route_and_method_are_openai_errors(gateway: GatewayProcess) -> None:
    status, _, body = await post(gateway, "/v1/nope", {})
    assert (status, body["error"]["code"], body["error"]["message"]) == (404, "unknown_url",
                                                                         "Invalid URL (POST /v1/nope)")
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.url + "/v1/chat/completions") as resp:
            assert resp.status == 405
            assert "POST" in resp.headers["Allow"]
            assert (await resp.json())["error"]["code"] == "method_not_allowed"


@pytest.mark.asyncio
async def test_upstream_429_keeps_status_and_retry_after(gateway: GatewayProcess) -> None:
    status, headers, body = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "error429"})
    assert (status, headers["Retry-After"]) == (429, "3")
    assert body == {"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                              "code": "rate_limit_exceeded"}}


@pytest.mark.asyncio
async def test_context_length_400_keeps_its_code(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client(gateway).completions.create(model=MODEL, prompt="toolong", max_tokens=10**9)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")
    assert info.value.body["message"] == (
        f"This model's maximum context length is 8192 tokens. However, you requested {10**9 + NUM_PROMPT_TOKENS} "
        f"tokens ({NUM_PROMPT_TOKENS} in the messages, {10**9} in the completion). Please reduce the length of the "
        "messages or completion.")


@pytest.mark.asyncio
async def test_health_follows_live_workers(gateway: GatewayProcess, peers: FakePeers) -> None:
    peers.num_workers = 0
    try:
        await asyncio.sleep(0.6)  # past the gateway's status cache
        status, text = await get(gateway, "/health")
        assert status == 503 and json.loads(text)["error"]["message"] == "No live worker."
        status, _, body = await post(gateway, "/v1/chat/completions", CHAT)
        assert (status, body["error"]["code"]) == (503, "service_unavailable")
    finally:
        peers.num_workers = 1
    await asyncio.sleep(0.6)
    assert await get(gateway, "/health") == (200, '{"status":"ok"}')


@pytest.mark.asyncio
async def test_metrics_count_requests_and_tokens(gateway: GatewayProcess) -> None:
    def sample(text: str, name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[-1]) if lines else 0.0

    ok = 'radixserve_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}'
    _, before = await get(gateway, "/metrics")
    await client(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    status, after = await get(gateway, "/metrics")
    assert status == 200
    assert sample(after, ok) - sample(before, ok) == 1
    assert sample(after, "radixserve_gateway_completion_tokens_total") - \
        sample(before, "radixserve_gateway_completion_tokens_total") == 3
    ttft = 'radixserve_gateway_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"}'
    assert sample(after, ttft) - sample(before, ttft) == 1
    assert sample(after, "radixserve_gateway_requests_in_flight") == 0


@pytest.mark.asyncio
async def test_metrics_append_the_schedulers_series(gateway: GatewayProcess, peers: FakePeers) -> None:
    status, text = await get(gateway, "/metrics")
    assert status == 200
    assert text.endswith(SCHEDULER_METRICS.decode())
    assert "radixserve_gateway_scheduler_metrics_up 1.0\n" in text
    peers.answers_metrics = False
    try:
        status, text = await get(gateway, "/metrics")  # the scheduler answers status, not metrics: after the timeout
    finally:
        peers.answers_metrics = True
    assert status == 200
    assert "radixserve_gateway_scheduler_metrics_up 0.0\n" in text
    assert "radixserve_gateway_requests_total" in text
    assert "worker_id" not in text


@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_aborts(gateway: GatewayProcess, peers: FakePeers) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(gateway.url + "/v1/chat/completions",
                                  json={**CHAT, "messages": [{"role": "user", "content": "slow"}], "stream": True})
        assert resp.status == 200
        first = json.loads((await resp.content.readline()).decode().removeprefix("data: "))
        resp.close()
    abort = await wait_for(lambda: next((a for a in peers.aborts if a.request_id == first["id"]), None))
    assert abort == AbortRequest(first["id"], "client_disconnected")


# --- the strict gateway: auth, limits, timeouts, no scheduler ---

AUTH = {"Authorization": "Bearer k2"}


@pytest.mark.asyncio
async def test_auth(strict_gateway: GatewayProcess) -> None:
    status, _, body = await post(strict_gateway, "/v1/completions", {"model": MODEL, "prompt": "a"})
    assert (status, body["error"]["code"]) == (401, "missing_api_key")
    status, _, body = await post(strict_gateway, "/v1/completions", {"model": MODEL, "prompt": "a"},
                                 headers={"Authorization": "Bearer k3"})
    assert (status, body["error"]["code"], body["error"]["message"]) == (401, "invalid_api_key",
                                                                         "Incorrect API key provided.")
    with pytest.raises(openai.AuthenticationError):
        await client(strict_gateway, "wrong").models.list()
    reply = await client(strict_gateway, "k1").completions.create(model=MODEL, prompt="a")
    assert reply.choices[0].text == "Hello #0"
    assert (await get(strict_gateway, "/metrics"))[0] == 401  # only /health is open when keys are set
    assert (await get(strict_gateway, "/metrics", headers={"Authorization": "Bearer k2"}))[0] == 200


@pytest.mark.asyncio
async def test_health_without_scheduler_is_503(strict_gateway: GatewayProcess) -> None:
    status, text = await get(strict_gateway, "/health")
    assert status == 503
    assert json.loads(text)["error"]["message"] == "No scheduler answered a status request."


@pytest.mark.asyncio
async def test_metrics_without_scheduler_are_the_gateways_own(strict_gateway: GatewayProcess) -> None:
    status, text = await get(strict_gateway, "/metrics", headers=AUTH)
    assert status == 200
    assert "radixserve_gateway_scheduler_metrics_up 0.0\n" in text
    assert "# TYPE radixserve_gateway_requests_total counter" in text
    assert "worker_id" not in text


@pytest.mark.asyncio
async def test_oversize_body_413(strict_gateway: GatewayProcess) -> None:
    big = {"model": MODEL, "prompt": "x" * 70_000}
    status, _, body = await post(strict_gateway, "/v1/completions", big, headers=AUTH)
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert body["error"]["message"] == "Request body too large: the limit is 65536 bytes."


@pytest.mark.asyncio
async def test_timeout_is_504_and_aborts(strict_gateway: GatewayProcess, peers: FakePeers) -> None:
    started = time.monotonic()
    status, _, body = await post(strict_gateway, "/v1/completions", {"model": MODEL, "prompt": "slow"},
                                 headers=AUTH)
    assert 1.4 < time.monotonic() - started < 5
    assert (status, body["error"]["code"], body["error"]["type"]) == (504, "timeout", "server_error")
    abort = await wait_for(lambda: peers.aborts[-1] if peers.aborts and peers.aborts[-1].reason == "timeout"
                           else None)
    assert abort.request_id == peers.requests[-1].request_id


@pytest.mark.asyncio
async def test_concurrency_limit_429(strict_gateway: GatewayProcess) -> None:
    async with aiohttp.ClientSession() as session:
        slow = await session.post(strict_gateway.url + "/v1/completions", headers=AUTH,
                                  json={"model": MODEL, "prompt": "slow", "stream": True})
        assert slow.status == 200
        await slow.content.readline()
        status, headers, body = await post(strict_gateway, "/v1/completions", {"model": MODEL, "prompt": "a"},
                                           headers=AUTH)
        assert (status, headers["Retry-After"], body["error"]["code"]) == (429, "1", "rate_limit_exceeded")
        slow.close()
