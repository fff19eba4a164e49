"""`radixserve bench --compare`'s answer line and SLO re-scoring (pure, exact)."""
from __future__ import annotations

from radixserve.bench.metrics import RequestRecord, summarize
from radixserve.bench.report import answer, with_slo


def _run(label: str, ttfts: list[float], tpots_s: list[float], duration_s: float = 10.0,
         slo: tuple[float | None, float | None] = (None, None)) -> dict:
    records = [RequestRecord(i, ttft_s=t, e2e_s=t + p * 9, num_output_tokens=10, max_tokens=10)
               for i, (t, p) in enumerate(zip(ttfts, tpots_s))]
    return {"label": label, "figures": summarize(records, duration_s, *slo),
            "requests": [r.to_json() for r in records]}


def test_rescoring_counts_requests_within_the_new_slo() -> None:
    run = _run("a", [0.5, 1.5, 3.0], [0.05, 0.2, 0.05])
    scored = with_slo(run, 2000, 100)
    assert scored["figures"]["num_good"] == 1 and scored["figures"]["goodput"] == 0.1
    assert with_slo(run, 4000, None)["figures"]["num_good"] == 3
    assert scored["figures"]["ttft"] == run["figures"]["ttft"]


def test_answer_picks_the_higher_goodput_under_the_slo() -> None:
    colocated = _run("colocated", [0.5, 0.6, 5.0], [0.05, 0.3, 0.3], slo=(2000, 100))
    pd = _run("pd", [0.7, 0.8, 0.9], [0.06, 0.06, 0.07], slo=(2000, 100))
    line = answer([colocated, pd])
    assert line.startswith("answer: choose pd (highest goodput under TTFT <= 2000 ms and TPOT <= 100 ms).")
    assert "colocated: TTFT P90" in line and "goodput 0.100" in line and "goodput 0.300" in line


def test_answer_without_an_slo_goes_by_throughput() -> None:
    fast = _run("fast", [0.5], [0.05], duration_s=5.0)
    slow = _run("slow", [0.5], [0.05], duration_s=10.0)
    assert answer([slow, fast]).startswith("answer: choose fast (highest output throughput (no SLO given")
