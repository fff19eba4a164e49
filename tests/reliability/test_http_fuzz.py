"""The HTTP API under hypothesis-generated input, against a real `radixserve serve` (random:tiny-llama, its
context cut to 64 tokens so any valid request ends fast): OpenAI-shaped bodies with plausible and arbitrary
values on our three endpoints, and raw requests (any method, path, content type, bytes). No answer is a 5xx,
every 200 is a well-formed completion, and afterwards the server is alive with nothing in flight."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cluster import MODEL, free_port, http_status, scheduler_status, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "200"))  # per test
COUNTS = {"requests": 0, "5xx": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("httpfuzz") / "serve.log"
    env = {**os.environ, "RADIXSERVE_MAX_MODEL_LEN": "64", "RADIXSERVE_REQUEST_TIMEOUT_S": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model", MODEL, "--device", "cpu",
                             "--port", str(port), "--num-pages", "256"], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or http_status(url + "/health") == 200, 90, 0.2)
        assert proc.poll() is None, log_path.read_text()
        yield proc, url
        print(f"\nHTTP fuzz: {COUNTS['requests']} requests, {COUNTS['5xx']} 5xx")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        text = log_path.read_text()
        assert "handler failed" not in text and "[error" not in text
        assert "Error handling request" not in text  # aiohttp's traceback for a request it could not parse


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=4), max_leaves=12)
SMALL_INT = st.integers(-3, 70)
WIDE_INT = st.sampled_from([-2**63 - 1, -2**63, -1, 0, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30])
TOKEN_IDS = st.lists(st.integers(-2, 600) | WIDE_INT, max_size=70)
NUMBER = st.floats(-3, 3) | st.integers(-3, 3) | st.sampled_from([1e308, -1e308, 5e-324, 0.0, -0.0])


def plausible(values: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right shape, sometimes any JSON at all."""
    return st.one_of(values, values, values, JSON)


MODEL_NAME = st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), st.sampled_from(["", "gpt-4", MODEL.upper()]),
                       JSON)
COMMON = {
    "max_tokens": plausible(SMALL_INT | WIDE_INT), "temperature": plausible(NUMBER), "top_p": plausible(NUMBER),
    "n": plausible(st.integers(-1, 20)), "stream": plausible(st.booleans()),
    "stream_options": plausible(st.fixed_dictionaries({}, optional={"include_usage": plausible(st.booleans())})),
    "stop": plausible(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=6)),
    "presence_penalty": plausible(NUMBER), "frequency_penalty": plausible(NUMBER),
    "seed": plausible(SMALL_INT | WIDE_INT), "logit_bias": plausible(st.just({})),
    "top_k": plausible(SMALL_INT | WIDE_INT), "min_p": plausible(NUMBER), "repetition_penalty": plausible(NUMBER),
    "ignore_eos": plausible(st.booleans()), "stop_token_ids": plausible(TOKEN_IDS),
    "skip_special_tokens": plausible(st.booleans()), "user": plausible(st.text(max_size=8)),
    "frobnicate": JSON,
}
COMPLETION = st.fixed_dictionaries(
    {"model": MODEL_NAME, "prompt": plausible(TOKEN_IDS | st.lists(TOKEN_IDS, max_size=2) | st.text(max_size=8))},
    optional={**COMMON, "logprobs": plausible(st.integers(-1, 7)), "best_of": plausible(st.integers(-1, 4)),
              "echo": plausible(st.booleans()), "suffix": plausible(st.text(max_size=3))})
PART = st.fixed_dictionaries({"type": plausible(st.sampled_from(["text", "image_url"])),
                              "text": plausible(st.text(max_size=8))})
MESSAGE = st.fixed_dictionaries(
    {"role": plausible(st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]))},
    optional={"content": plausible(st.text(max_size=8) | st.lists(PART, max_size=3)), "name": JSON,
              "tool_calls": JSON})
CHAT = st.fixed_dictionaries(
    {"model": MODEL_NAME, "messages": plausible(st.lists(MESSAGE, max_size=3))},
    optional={**COMMON, "max_completion_tokens": plausible(SMALL_INT | WIDE_INT), "logprobs": plausible(st.booleans()),
              "top_logprobs": plausible(st.integers(-1, 25)), "tools": plausible(st.just([])),
              "response_format": plausible(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
              "modalities": plausible(st.just(["text"]))})


def send(url: str, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> requests.Response:
    resp = requests.request(method, url + path, data=data, headers=headers, timeout=60)
    COUNTS["requests"] += 1
    COUNTS["5xx"] += resp.status_code >= 500
    return resp


def check_completion(resp: requests.Response, body: dict[str, Any], is_chat: bool) -> None:
    """A 200 is a whole, well-formed answer (SSE ending in [DONE] when streamed); an error is OpenAI-shaped."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], body)
    if resp.status_code != 200:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["type"]
        return
    if body.get("stream") is True:
        assert resp.text.endswith("data: [DONE]\n\n"), resp.text[-300:]
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        assert events and all("error" not in e for e in events), resp.text[-300:]
        return
    reply = resp.json()
    assert reply["object"] == ("chat.completion" if is_chat else "text_completion")
    prompt = body.get("prompt")
    is_batch = not is_chat and isinstance(prompt, list) and all(isinstance(p, (list, str)) for p in prompt)
    num_prompts = len(prompt) if is_batch else 1  # a batch answers n choices per prompt
    assert sorted(c["index"] for c in reply["choices"]) == list(range(num_prompts * (body.get("n") or 1)))
    assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"])


@settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=COMPLETION)
def test_completion_bodies_never_get_a_5xx(served: tuple[subprocess.Popen, str], body: dict[str, Any]) -> None:
    resp = send(served[1], "POST", "/v1/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"})
    check_completion(resp, body, is_chat=False)


@settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=CHAT)
def test_chat_bodies_never_get_a_5xx(served: tuple[subprocess.Popen, str], body: dict[str, Any]) -> None:
    resp = send(served[1], "POST", "/v1/chat/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"})
    check_completion(resp, body, is_chat=True)


PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", f"/v1/models/{MODEL}",
                         "/v1/models/x/y", "/health", "/metrics", "/", "/v1", "/v1/completions/",
                         "/%ff", "/v1/../health"]) | st.text(st.characters(codec="ascii", exclude_characters="?#"),
                                                             max_size=12).map(lambda p: "/" + p)
RAW_BODY = st.one_of(st.binary(max_size=300), JSON.map(lambda v: json.dumps(v).encode()),
                     st.sampled_from([b"[" * 50_000, b'{"model": "' + MODEL.encode() + b'", "prompt": [1e400]}',
                                      b"\xef\xbb\xbf{}", b'{"a": 1, "a": 2}', b"", b"null", b'"\xff"',
                                      b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"\\ud800" + b'"}']))
HEADERS = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x",
                                     "application/json; charset=latin-1", "application/x-www-form-urlencoded"]),
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "br", "identity", "x-bogus"]),
    "Accept": st.sampled_from(["text/event-stream", "*/*", "application/xml"])})


@settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]) | PATHS,
       data=RAW_BODY, headers=HEADERS)
def test_raw_requests_never_get_a_5xx(served: tuple[subprocess.Popen, str], method: str, path: str, data: bytes,
                                      headers: dict[str, str]) -> None:
    resp = send(served[1], method, path, data, headers)
    assert resp.status_code < 500 or (path == "/health" and resp.status_code == 503), (resp.status_code,
                                                                                      resp.text[:300])


def test_after_the_fuzz_the_server_serves_with_nothing_in_flight(served: tuple[subprocess.Popen, str]) -> None:
    proc, url = served
    assert proc.poll() is None
    assert all(c.is_running() for c in psutil.Process(proc.pid).children())
    resp = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                                                        "ignore_eos": True}, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    sched = next(a for c in psutil.Process(proc.pid).children() for a in c.cmdline()
                 if a.startswith("ipc://") and a.endswith("/scheduler"))
    wait_until(lambda: (s := scheduler_status(sched)) and s.num_in_flight == 0 and s.num_queued == 0, 10)
    metrics = requests.get(url + "/metrics", timeout=5).text
    assert "radixserve_gateway_requests_in_flight 0.0" in metrics
    assert not [line for line in metrics.splitlines() if 'status="5' in line and "/health" not in line]
