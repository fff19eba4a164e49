"""W6's time series (pure): snapshots of the client's running counts and the server's /metrics series become one
row per sampling window, and the steady-state ratio compares the last minute's throughput with the first's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.bench.scrape import SERVER_COUNTERS, SERVER_GAUGES

STEADY_WINDOW_S = 60.0  # last minute ÷ first minute ...
STEADY_MIN_DURATION_S = 180.0  # ... in runs of at least 3 minutes; shorter ones compare their first/last 20 %
STEADY_FRACTION = 0.2


@dataclass(frozen=True)
class Snapshot:
    """The running counts at t_s seconds from the loop's start, and the server's series scraped then."""

    t_s: float
    num_tokens: int  # output tokens received so far (the client's own count)
    num_finished: int  # requests finished so far
    num_in_flight: int
    server: dict[str, float | None]


def _short(name: str) -> str:
    return name.removeprefix("radixserve_").removesuffix("_total")


def _delta(before: float | None, after: float | None) -> float | None:
    """A counter's growth; None when either side is missing or it went back (the server restarted)."""
    if before is None or after is None or after < before:
        return None
    return after - before


def window_row(prev: Snapshot, cur: Snapshot) -> dict[str, Any]:
    """The window (prev, cur]: client throughput and finishes, the server's gauges at its end, its counters'
    growth in it, and the prefix-cache hit rate in it (Δhits / Δqueries; None without queries)."""
    span_s = cur.t_s - prev.t_s
    num_tokens = cur.num_tokens - prev.num_tokens
    row: dict[str, Any] = {
        "t_start_s": prev.t_s, "t_end_s": cur.t_s, "num_output_tokens": num_tokens,
        "output_tok_s": num_tokens / span_s if span_s > 0 else None,
        "num_finished": cur.num_finished - prev.num_finished, "num_in_flight": cur.num_in_flight,
    }
    row.update({_short(name): cur.server.get(name) for name in SERVER_GAUGES})
    row.update({_short(name): _delta(prev.server.get(name), cur.server.get(name)) for name in SERVER_COUNTERS})
    hits, queries = row["prefix_cache_hits"], row["prefix_cache_queries"]
    row["hit_rate"] = hits / queries if hits is not None and queries else None
    return row


def rows(snapshots: list[Snapshot]) -> list[dict[str, Any]]:
    return [window_row(a, b) for a, b in zip(snapshots, snapshots[1:])]


def _throughput(windows: list[dict[str, Any]]) -> float | None:
    span_s = sum(w["t_end_s"] - w["t_start_s"] for w in windows)
    return sum(w["num_output_tokens"] for w in windows) / span_s if span_s > 0 else None


def steady(windows: list[dict[str, Any]], duration_s: float, interval_s: float) -> dict[str, Any]:
    """steady_ratio: output tok/s over the last windows ÷ over the first ones, each side spanning a minute
    (runs of 3 minutes or more) or a fifth of the run (shorter ones), rounded to whole samples (at least one)."""
    is_minute = duration_s >= STEADY_MIN_DURATION_S
    target_s = STEADY_WINDOW_S if is_minute else STEADY_FRACTION * duration_s
    num = max(1, round(target_s / interval_s))
    first = _throughput(windows[:num]) if windows else None
    last = _throughput(windows[-num:]) if windows else None
    return {
        "steady_ratio": last / first if first and last is not None else None,
        "steady_basis": "first and last 60 s" if is_minute else "first and last 20 % (run shorter than 3 min)",
        "steady_num_samples": num,
        "first_output_tok_s": first,
        "last_output_tok_s": last,
    }
