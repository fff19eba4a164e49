"""`radixserve serve` end to end: the gateway's one /metrics shows every worker's engine series (through the
scheduler), and their counters agree with what the requests got."""
from __future__ import annotations

import time
import urllib.request
from collections import defaultdict

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
WORKER_SERIES = {  # sample names of every family with a worker_id label, by type
    "gauge": ["radixserve_num_requests_running", "radixserve_num_requests_waiting", "radixserve_kv_cache_usage_perc",
              "radixserve_prefix_cache_usage_perc"],
    "counter": ["radixserve_num_preemptions_total", "radixserve_prefix_cache_queries_total",
                "radixserve_prefix_cache_hits_total", "radixserve_prompt_tokens_total",
                "radixserve_generation_tokens_total"],
    "histogram": ["radixserve_request_queue_time_seconds", "radixserve_engine_step_seconds",
                  "radixserve_iteration_tokens_total", "radixserve_engine_step_sequences"],
}


def _scrape(url: str) -> dict[str, dict[str, float]]:
    """{sample name: {worker_id (or "" without one): value}}; histograms by their _count."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                samples[sample.name][sample.labels.get("worker_id", "")] = sample.value
    return samples


def _total(samples: dict[str, dict[str, float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


def _settled_scrape(url: str) -> dict:
    """A scrape once the engine series have caught up with earlier tests' requests (heartbeats carry them late):
    nothing running, and the token counters unchanged across more than two heartbeat intervals."""
    deadline = time.monotonic() + 30
    previous = _scrape(url)
    while True:
        time.sleep(1.2)
        current = _scrape(url)
        counters = ("radixserve_generation_tokens_total", "radixserve_prompt_tokens_total")
        if (all(_total(current, c) == _total(previous, c) for c in counters)
                and _total(current, "radixserve_num_requests_running") == 0) or time.monotonic() > deadline:
            return current
        previous = current


def test_metrics_show_each_workers_engine(served: str) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = _settled_scrape(served)
    prompt = "You are a careful assistant. " * 12 + "Name a colour."
    replies = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0) for n in (6, 9)]
    generated = sum(r.usage.completion_tokens for r in replies)
    prompt_tokens = sum(r.usage.prompt_tokens for r in replies)
    cached_tokens = sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
    name = "radixserve_generation_tokens_total"
    deadline = time.monotonic() + 30  # the workers' next heartbeats carry the counters
    after = _scrape(served)
    while _total(after, name) - _total(before, name) < generated and time.monotonic() < deadline:
        time.sleep(0.2)
        after = _scrape(served)

    assert _total(after, name) - _total(before, name) == generated
    assert _total(after, "radixserve_prompt_tokens_total") - _total(before, "radixserve_prompt_tokens_total") \
        == prompt_tokens
    for counter, expected in (("radixserve_prefix_cache_queries_total", prompt_tokens),
                              ("radixserve_prefix_cache_hits_total", cached_tokens),
                              ("radixserve_request_queue_time_seconds_count", 2)):
        assert _total(after, counter) - _total(before, counter) == expected, counter
    assert _total(after, "radixserve_engine_step_seconds_count") - \
        _total(before, "radixserve_engine_step_seconds_count") >= max(r.usage.completion_tokens for r in replies)
    worker_ids = set(after["radixserve_num_requests_running"])
    assert len(worker_ids) == 2 and "" not in worker_ids
    for kind, names in WORKER_SERIES.items():
        for series in names:
            sample = series + "_count" if kind == "histogram" else series
            assert set(after[sample]) == worker_ids, sample
    for usage in ("radixserve_kv_cache_usage_perc", "radixserve_prefix_cache_usage_perc"):
        assert all(0.0 <= v <= 1.0 for v in after[usage].values())
    assert after["radixserve_gateway_scheduler_metrics_up"] == {"": 1.0}
    assert after["radixserve_scheduler_workers"] == {"": 2.0}
