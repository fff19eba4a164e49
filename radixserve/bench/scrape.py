"""The prefix-cache hit rate from a server's Prometheus /metrics, for servers whose usage lacks cached_tokens."""
from __future__ import annotations

import aiohttp

# (cached prompt tokens, prompt tokens) counter names, by server
CACHE_COUNTERS = (
    ("radixserve_gateway_cached_prompt_tokens_total", "radixserve_gateway_prompt_tokens_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text → {metric name: sum over its label sets}; comments and malformed lines skipped."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


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


def hit_rate_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] - before[1] <= 0:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
