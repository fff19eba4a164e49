"""Per-request records and the run's figures: percentiles, throughput, goodput, errors, cache hit rate, and the
totals that account for every request (pure)."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
# NOTE: one method for every percentile we report: numpy's default "linear" interpolation between the
# closest ranks (Hyndman & Fan type 7, also Excel's PERCENTILE.INC); the tests pin exact values.
PERCENTILE_METHOD = "linear"


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, start_s relative to the run's start."""

    index: int
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive content chunks
    num_prompt_tokens: int = 0  # the server's usage when it reports it, else the client's count
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    max_tokens: int = 0
    finish_reason: str | None = None  # the stream's last non-null choice finish_reason
    error_kind: str | None = None  # http_<code>, timeout, connection, stream_error, incomplete_stream
    error_message: str = ""
    session_id: int | None = None
    turn: int | None = None
    output_text: str = ""

    @property
    def is_ok(self) -> bool:
        return self.error_kind is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (out - 1); None below two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body.pop("output_text")
        body["tpot_s"] = self.tpot_s
        return body


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method=PERCENTILE_METHOD))


def latency_stats(values: list[float]) -> dict[str, float | None]:
    """mean and P50/P90/P99 in milliseconds; None for an empty list."""
    if not values:
        return {"mean_ms": None, **{f"p{q}_ms": None for q in PERCENTILES}}
    stats = {"mean_ms": float(np.mean(values)) * 1e3}
    stats.update({f"p{q}_ms": percentile(values, q) * 1e3 for q in PERCENTILES})
    return stats


def meets_slo(record: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request within both SLOs; a missing SLO holds, and one-token outputs have no TPOT."""
    if not record.is_ok or record.ttft_s is None:
        return False
    if slo_ttft_ms is not None and record.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = record.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """The run's figures from its measured (non-warm-up) records over duration_s of wall time."""
    ok = [r for r in records if r.is_ok]
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_output = sum(r.num_output_tokens for r in ok)
    reported = [r for r in ok if r.num_cached_tokens is not None]
    num_reported_prompt = sum(r.num_prompt_tokens for r in reported)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    num_good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
    return {
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": dict(sorted(Counter(r.error_kind for r in records if not r.is_ok).items())),
        "num_short_outputs": sum(r.num_output_tokens < r.max_tokens for r in ok),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "input_tok_s": num_prompt / duration_s if duration_s > 0 else None,
        "output_tok_s": num_output / duration_s if duration_s > 0 else None,
        "ttft": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl": latency_stats([gap for r in ok for gap in r.itl_s]),
        "e2e": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "num_good": num_good if has_slo else None,
        "goodput": (num_good / duration_s if duration_s > 0 else None) if has_slo else None,
        "num_cached_tokens": sum(r.num_cached_tokens for r in reported) if reported else None,
        "cache_hit_rate": (sum(r.num_cached_tokens for r in reported) / num_reported_prompt
                           if reported and num_reported_prompt else None),
        "cache_hit_rate_source": "usage" if reported else None,
    }


def totals(records: list[RequestRecord], is_ignore_eos: bool) -> dict[str, Any]:
    """Every request accounted for: sent = ok + failed; finish reasons (None as "none") sum to sent.

    The expected completion total (sum of max_tokens over every request sent) exists only with ignore_eos.
    is_exact: ignore_eos, no request failed, and every one returned exactly max_tokens tokens, so the
    completion total equals the expected one; None without ignore_eos, where lengths are the model's choice.
    """
    ok = [r for r in records if r.is_ok]
    num_short = sum(r.num_output_tokens < r.max_tokens for r in ok)
    num_over = sum(r.num_output_tokens > r.max_tokens for r in ok)
    failed = Counter(r.error_kind for r in records if not r.is_ok)
    return {
        "num_sent": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "failed_by_kind": dict(sorted(failed.items())),
        "num_completion_tokens": sum(r.num_output_tokens for r in ok),
        "num_expected_tokens": sum(r.max_tokens for r in records) if is_ignore_eos else None,
        "finish_reasons": dict(sorted(Counter(r.finish_reason or "none" for r in records).items())),
        "is_ignore_eos": is_ignore_eos,
        "num_short": num_short,
        "num_over": num_over,
        "is_exact": (not failed and num_short == 0 and num_over == 0) if is_ignore_eos else None,
    }
