"""A server's Prometheus /metrics: the prefix-cache hit rate (for servers whose usage lacks cached_tokens) and
the worker series that W6 samples over time."""
from __future__ import annotations

import aiohttp

# (cached prompt tokens, prompt tokens) counter names, by server
CACHE_COUNTERS = (
    ("radixserve_gateway_cached_prompt_tokens_total", "radixserve_gateway_prompt_tokens_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)
# the worker series W6 samples: gauges read as they are, counters as differences between samples. Each carries
# a worker_id label: the *_perc fractions are averaged over workers, the rest summed.
SERVER_GAUGES = ("radixserve_kv_cache_usage_perc", "radixserve_prefix_cache_usage_perc",
                 "radixserve_num_requests_running", "radixserve_num_requests_waiting")
SERVER_COUNTERS = ("radixserve_prefix_cache_queries_total", "radixserve_prefix_cache_hits_total",
                   "radixserve_num_preemptions_total")


def parse_samples(text: str) -> dict[str, list[float]]:
    """Prometheus text → {metric name: its values, one per label set}; comments and malformed lines skipped."""
    values: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        values.setdefault(name_part.split("{", 1)[0].strip(), []).append(number)
    return values


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text → {metric name: sum over its label sets}."""
    return {name: sum(values) for name, values in parse_samples(text).items()}


def cache_counts(counters: dict[str, float]) -> tuple[float, float] | None:
    """(cached, total) prompt tokens from the first known counter pair present."""
    for hits, total in CACHE_COUNTERS:
        if hits in counters and total in counters:
            return counters[hits], counters[total]
    return None


async def fetch_cache_counts(base_url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base_url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    return None
                return cache_counts(parse_counters(await r.text()))
    except (aiohttp.ClientError, TimeoutError):
        return None


def server_series(samples: dict[str, list[float]]) -> dict[str, float | None]:
    """The W6 series by name (parse_samples' values combined over workers); None where the server exports none."""
    series: dict[str, float | None] = {}
    for name in (*SERVER_GAUGES, *SERVER_COUNTERS):
        values = samples.get(name)
        if not values:
            series[name] = None
        else:
            series[name] = sum(values) / len(values) if name.endswith("_perc") else sum(values)
    return series


async def fetch_server_series(http: aiohttp.ClientSession, base_url: str, headers: dict[str, str],
                              timeout_s: float = 5.0) -> dict[str, float | None]:
    """server_series of one scrape; every series None when /metrics cannot be read."""
    try:
        async with http.get(f"{base_url}/metrics", headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status == 200:
                return server_series(parse_samples(await r.text()))
    except (aiohttp.ClientError, TimeoutError):
        pass
    return server_series({})


def hit_rate_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] - before[1] <= 0:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
