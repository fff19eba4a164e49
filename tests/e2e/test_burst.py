"""`radixserve serve` with its defaults on the CPU takes a burst of 600 streaming requests sent at once: every
one ends 200 with exactly max_tokens tokens, and the gateway's /metrics shows the engine that served them."""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import aiohttp
import pytest

from tests.e2e.conftest import series_sum, serving

pytestmark = pytest.mark.slow
NUM_REQUESTS = 600
MAX_TOKENS = 4
ENGINE_SERIES = ("radixserve_num_requests_running", "radixserve_num_requests_waiting",
                 "radixserve_kv_cache_usage_perc", "radixserve_prefix_cache_usage_perc",
                 "radixserve_num_preemptions_total", "radixserve_prefix_cache_queries_total",
                 "radixserve_prefix_cache_hits_total", "radixserve_prompt_tokens_total",
                 "radixserve_generation_tokens_total", "radixserve_request_queue_time_seconds_bucket",
                 "radixserve_engine_step_seconds_bucket", "radixserve_iteration_tokens_total_bucket",
                 "radixserve_engine_step_sequences_bucket", "radixserve_scheduler_queued_requests")


async def stream_one(http: aiohttp.ClientSession, url: str, index: int) -> tuple[int, int, int, str | None]:
    """→ (HTTP status, text chunks, usage completion_tokens, last finish_reason) of one streamed completion."""
    body = {"model": "smollm2-135m-instruct", "prompt": [1 + (index * 7 + j) % 4000 for j in range(12)],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    num_chunks, num_completion, finish_reason = 0, -1, None
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, 0, 0, None
        async for line in resp.content:
            payload = line.decode().strip().removeprefix("data: ")
            if not payload or payload == "[DONE]":
                continue
            event = json.loads(payload)
            for choice in event.get("choices", []):
                num_chunks += bool(choice.get("text"))
                finish_reason = choice.get("finish_reason") or finish_reason
            if event.get("usage"):
                num_completion = event["usage"]["completion_tokens"]
    return 200, num_chunks, num_completion, finish_reason


async def burst(url: str) -> list[tuple[int, int, int, str | None]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as http:
        return await asyncio.gather(*(stream_one(http, url, i) for i in range(NUM_REQUESTS)))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_a_burst_of_600_streams_all_finish_exactly(tmp_path) -> None:
    with serving(["--device", "cpu"], tmp_path / "serve.log") as url:
        results = asyncio.run(burst(url))
        statuses = [status for status, *_ in results]
        assert statuses.count(200) == NUM_REQUESTS, f"statuses: {sorted(set(statuses))}"
        assert {usage for _, _, usage, _ in results} == {MAX_TOKENS}
        assert {finish for *_, finish in results} == {"length"}
        assert sum(usage for _, _, usage, _ in results) == NUM_REQUESTS * MAX_TOKENS
        expected = NUM_REQUESTS * MAX_TOKENS
        deadline = time.monotonic() + 30  # heartbeats carry the engine's series to the scheduler
        while series_sum(text := scrape(url), "radixserve_generation_tokens_total") < expected:
            assert time.monotonic() < deadline, "the engine's generation counter never reached the tokens served"
            time.sleep(0.5)
        for name in ENGINE_SERIES:
            assert re.search(rf"^{name}[{{ ]", text, re.MULTILINE), f"{name} missing from /metrics"
        assert re.search(r'^radixserve_num_requests_running{[^}]*worker_id="', text, re.MULTILINE)
        assert series_sum(text, "radixserve_generation_tokens_total") == expected
        assert series_sum(text, "radixserve_prompt_tokens_total") == NUM_REQUESTS * 12
        assert series_sum(text, "radixserve_num_requests_running") == 0
