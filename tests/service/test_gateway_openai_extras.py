"""The gateway as a real process with the scripted fake peers of test_gateway_service: batched completion prompts
(one generation per prompt, choices p * n + i, usage summed, one failure fails the call and aborts the rest), echo,
/tokenize and /detokenize, and request bodies in an encoding it does not read."""
from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.gateway.protocol import MAX_PROMPTS
from shared.messages import AbortRequest
from tests.service.test_gateway_service import (MODEL, NUM_CACHED_TOKENS, NUM_PROMPT_TOKENS, FakePeers,
                                                GatewayProcess, client, gateway, peers, post, tmp_dir, wait_for)

__all__ = ["gateway", "peers", "tmp_dir"]  # module fixtures of test_gateway_service: a gateway of this module's own


@pytest.fixture(scope="module")
def keyed_gateway(peers: FakePeers, tmp_dir: str) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(["--tokenizer-addrs", peers.tokenizer_addr, "--scheduler-addrs", peers.scheduler_addr,
                         "--api-keys", "k1", "--model-id", MODEL], Path(tmp_dir) / "keyed.log")
    yield gw
    assert gw.stop() == 0


# --- batched prompts ---

@pytest.mark.asyncio
async def test_sdk_batched_prompts_fan_out(gateway: GatewayProcess, peers: FakePeers) -> None:
    reply = await client(gateway).completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, max_tokens=3)
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [
        (p * 2 + i, f"Hello #{i}", "length") for p in range(3) for i in range(2)]
    sent = peers.requests[-3:]
    assert [(r.request_id, r.prompt_text, r.sampling.n) for r in sent] == [
        (f"{reply.id}-{p}", text, 2) for p, text in enumerate("abc")]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        3 * NUM_PROMPT_TOKENS, 18, 3 * NUM_PROMPT_TOKENS + 18)
    assert reply.usage.prompt_tokens_details.cached_tokens == 3 * NUM_CACHED_TOKENS


@pytest.mark.asyncio
async def test_sdk_batched_token_prompts_stream(gateway: GatewayProcess, peers: FakePeers) -> None:
    stream = await client(gateway).completions.create(model=MODEL, prompt=[[1, 2], [3]], n=2, stream=True,
                                                      stream_options={"include_usage": True})
    texts, finishes, usages = [""] * 4, {}, []
    async for chunk in stream:
        if chunk.usage is not None:
            usages.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == ["Hello #0", "Hello #1"] * 2
    assert finishes == dict.fromkeys(range(4), "stop")
    assert usages == [(2 * NUM_PROMPT_TOKENS, 12)]
    assert [r.prompt_token_ids for r in peers.requests[-2:]] == [[1, 2], [3]]


@pytest.mark.asyncio
async def test_one_failed_prompt_fails_the_call_and_aborts_the_others(gateway: GatewayProcess,
                                                                      peers: FakePeers) -> None:
    status, headers, body = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ["slow", "error429"]})
    assert (status, headers["Retry-After"]) == (429, "3")
    assert body == {"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                              "code": "rate_limit_exceeded"}}
    rid = peers.requests[-1].request_id.rsplit("-", 1)[0]
    await wait_for(lambda: any(a.request_id == f"{rid}-0" for a in peers.aborts))
    aborted = {a.request_id: a.reason for a in peers.aborts if a.request_id.startswith(rid)}
    assert aborted == {f"{rid}-0": "rate_limit_exceeded"}  # the failed prompt ended upstream: no abort for it


@pytest.mark.asyncio
async def test_one_prompt_failing_mid_stream_ends_the_stream_and_aborts_the_others(gateway: GatewayProcess,
                                                                                   peers: FakePeers) -> None:
    with pytest.raises(openai.APIError, match="worker died"):
        stream = await client(gateway).completions.create(model=MODEL, prompt=["slow", "midstream"], stream=True)
        async for _ in stream:
            pass
    rid = peers.requests[-1].request_id.rsplit("-", 1)[0]
    abort = await wait_for(lambda: next((a for a in peers.aborts if a.request_id == f"{rid}-0"), None))
    assert abort == AbortRequest(f"{rid}-0", "client_disconnected")
    assert not any(a.request_id == f"{rid}-1" for a in peers.aborts)


@pytest.mark.asyncio
async def test_a_batch_over_the_limit_is_400(gateway: GatewayProcess) -> None:
    status, _, body = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ["a"] * (MAX_PROMPTS + 1)})
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "array_above_max_length", "prompt")


# --- echo ---

@pytest.mark.asyncio
async def test_echo_prepends_each_prompt(gateway: GatewayProcess) -> None:
    reply = await client(gateway).completions.create(model=MODEL, prompt=["Say: ", "Tell: "], echo=True, n=2)
    assert [c.text for c in reply.choices] == ["Say: Hello #0", "Say: Hello #1", "Tell: Hello #0", "Tell: Hello #1"]
    by_ids = await client(gateway).completions.create(model=MODEL, prompt=[72, 105], echo=True)
    assert by_ids.choices[0].text == "HiHello #0"  # the fake tokenizer's text of ids 72, 105
    assert by_ids.usage.completion_tokens == 3


@pytest.mark.asyncio
async def test_echo_streams_the_prompt_first(gateway: GatewayProcess) -> None:
    stream = await client(gateway).completions.create(model=MODEL, prompt=[[72, 105], [79]], echo=True,
                                                      stream=True)
    chunks = [(c.choices[0].index, c.choices[0].text) async for c in stream]
    assert chunks[:2] == [(0, "Hi"), (1, "O")]
    assert ["".join(text for index, text in chunks if index == i) for i in (0, 1)] == ["HiHello #0", "OHello #0"]


@pytest.mark.asyncio
async def test_echo_of_an_undecodable_prompt_is_the_tokenizers_400(gateway: GatewayProcess,
                                                                   peers: FakePeers) -> None:
    num_requests = len(peers.requests)
    status, _, body = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": [[5], [0]], "echo": True})
    assert (status, body["error"]["message"]) == (400, "token id 0 is not allowed")
    assert len(peers.requests) == num_requests  # nothing generated


@pytest.mark.asyncio
async def test_echo_with_logprobs_asks_for_the_prompts_logprobs(gateway: GatewayProcess, peers: FakePeers) -> None:
    reply = await client(gateway).completions.create(model=MODEL, prompt=[[1, 2]], echo=True, logprobs=1,
                                                     max_tokens=1)
    assert reply.choices[0].text.startswith("\x01\x02")  # the fake tokenizer's text of ids 1, 2
    sampling = peers.requests[-1].sampling
    assert (sampling.logprobs, sampling.prompt_logprobs, sampling.max_tokens) == (1, 1, 1)


# --- /tokenize and /detokenize ---

@pytest.mark.asyncio
async def test_tokenize_and_detokenize(gateway: GatewayProcess) -> None:
    status, _, body = await post(gateway, "/tokenize", {"model": MODEL, "prompt": "Hi!"})
    assert (status, body) == (200, {"count": 3, "max_model_len": 8192, "tokens": [72, 105, 33], "token_strs": None})
    status, _, body = await post(gateway, "/tokenize", {"messages": [{"role": "user", "content": "yo"}]})
    assert (status, body["tokens"]) == (200, [121, 111])
    status, _, body = await post(gateway, "/detokenize", {"model": MODEL, "tokens": [72, 105]})
    assert (status, body) == (200, {"prompt": "Hi"})


@pytest.mark.asyncio
async def test_tokenize_errors_are_openai_shaped(gateway: GatewayProcess) -> None:
    status, _, body = await post(gateway, "/detokenize", {"tokens": [0]})
    assert (status, body["error"]["message"]) == (400, "token id 0 is not allowed")
    status, _, body = await post(gateway, "/tokenize", {"model": "nope", "prompt": "a"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    status, _, body = await post(gateway, "/tokenize", {"prompt": 5})
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "prompt", "invalid_type")


@pytest.mark.asyncio
async def test_tokenize_needs_the_key(keyed_gateway: GatewayProcess) -> None:
    status, _, body = await post(keyed_gateway, "/tokenize", {"prompt": "a"})
    assert (status, body["error"]["code"]) == (401, "missing_api_key")
    status, _, body = await post(keyed_gateway, "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer k1"})
    assert (status, body["tokens"]) == (200, [97])


# --- request bodies in an encoding the gateway does not read (issue 31, item 9) ---

@pytest.mark.asyncio
@pytest.mark.parametrize("encoding", ["br", "zstd", "x-bogus"])
async def test_unsupported_content_encoding_is_a_json_415_logged_in_one_line(gateway: GatewayProcess,
                                                                             encoding: str) -> None:
    before = gateway.log_path.read_text().splitlines()
    status, headers, body = await post(gateway, "/v1/completions", data=b"\x1b\x00garbage",
                                       headers={"Content-Encoding": encoding, "Content-Type": "application/json"})
    assert (status, headers["Content-Type"], headers["Accept-Encoding"]) == (
        415, "application/json", "gzip, deflate, identity")
    assert body["error"]["code"] == "unsupported_content_encoding" and encoding in body["error"]["message"]
    assert _new_events(gateway, len(before)).count("unreadable request body") == 1


@pytest.mark.asyncio
async def test_unsupported_encoding_without_a_key_is_a_json_401(keyed_gateway: GatewayProcess) -> None:
    for encoding in ("br", "gzip"):  # the gzip body is not gzip: never read, so never an error
        status, headers, body = await post(keyed_gateway, "/v1/completions", data=b"\x1b\x00garbage",
                                           headers={"Content-Encoding": encoding})
        assert (status, headers["Content-Type"], body["error"]["code"]) == (
            401, "application/json", "missing_api_key")
    assert "Traceback" not in keyed_gateway.log_path.read_text()



@pytest.mark.asyncio
async def test_gzip_bodies_are_read_and_lying_ones_are_400(gateway: GatewayProcess) -> None:
    payload = json.dumps({"model": MODEL, "prompt": "a"}).encode()
    status, _, body = await post(gateway, "/v1/completions", data=gzip.compress(payload),
                                 headers={"Content-Encoding": "gzip"})
    assert (status, body["choices"][0]["text"]) == (200, "Hello #0")
    status, _, body = await post(gateway, "/v1/completions", data=payload, headers={"Content-Encoding": "gzip"})
    assert (status, body["error"]["code"]) == (400, "invalid_body")


@pytest.mark.asyncio
async def test_malformed_http_is_logged_in_one_line(gateway: GatewayProcess) -> None:
    before = len(gateway.log_path.read_text().splitlines())
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    assert (await reader.readline()).endswith(b" 400 Bad Request\r\n")
    writer.close()
    await wait_for(lambda: "http server error" in _new_events(gateway, before))
    assert _new_events(gateway, before).count("http server error") == 1


def _new_events(gw: GatewayProcess, num_old_lines: int) -> list[str]:
    """The events of the log lines after the first num_old_lines; every line must be one JSON object."""
    return [json.loads(line)["event"] for line in gw.log_path.read_text().splitlines()[num_old_lines:]]


def test_no_traceback_was_logged(gateway: GatewayProcess, keyed_gateway: GatewayProcess) -> None:
    assert "Traceback" not in gateway.log_path.read_text() + keyed_gateway.log_path.read_text()
