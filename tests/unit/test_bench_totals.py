"""radixserve bench's accounting: totals and finish reasons from synthetic records, W6's requests, window rows,
steady ratio and /metrics series (pure)."""
from __future__ import annotations

import pytest

from radixserve.bench import report, scrape, timeline, workloads
from radixserve.bench.client import StreamTimer
from radixserve.bench.metrics import RequestRecord, totals
from radixserve.bench.workloads import IdPrompts, Settings


def _record(index: int, out: int, max_tokens: int, reason: str | None = "length",
            error: str | None = None) -> RequestRecord:
    return RequestRecord(index, num_output_tokens=out, max_tokens=max_tokens, finish_reason=reason, error_kind=error)


def test_totals_account_for_every_request():
    records = [_record(0, 8, 8), _record(1, 8, 8), _record(2, 5, 8, "stop"), _record(3, 2, 8, None, "timeout"),
               _record(4, 0, 8, None, "http_429"), _record(5, 0, 8, None, "http_429")]
    assert totals(records, is_ignore_eos=True) == {
        "num_sent": 6, "num_ok": 3, "num_failed": 3, "failed_by_kind": {"http_429": 2, "timeout": 1},
        "num_completion_tokens": 21, "num_expected_tokens": 48,
        "finish_reasons": {"length": 2, "none": 3, "stop": 1},
        "is_ignore_eos": True, "num_short": 1, "num_over": 0, "is_exact": False,
    }


def test_totals_exact_only_when_every_request_returns_max_tokens():
    exact = [_record(0, 8, 8), _record(1, 4, 4)]
    assert totals(exact, True)["is_exact"] is True
    assert totals(exact, True)["num_completion_tokens"] == totals(exact, True)["num_expected_tokens"] == 12
    assert totals([*exact, _record(2, 5, 4)], True)["num_over"] == 1
    assert totals([*exact, _record(2, 5, 4)], True)["is_exact"] is False
    assert totals([*exact, _record(2, 4, 4, None, "connection")], True)["is_exact"] is False  # a failure
    free = totals([_record(0, 3, 8, "stop")], is_ignore_eos=False)
    assert (free["is_exact"], free["num_expected_tokens"], free["num_short"]) == (None, None, 1)
    assert totals([], True) == {**totals([], True), "num_sent": 0, "num_completion_tokens": 0, "is_exact": True}


def test_stream_timer_keeps_the_last_finish_reason():
    timer = StreamTimer(0.0)
    for at, reason in ((0.1, "null"), (0.2, '"length"')):
        timer.feed(f'data: {{"choices": [{{"index": 0, "text": "a", "finish_reason": {reason}}}]}}\n\n'.encode(), at)
    timer.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata: [DONE]\n\n', 0.3)
    record = RequestRecord(0, max_tokens=2)
    timer.fill(record)
    assert (record.finish_reason, record.num_output_tokens, record.is_ok) == ("length", 2, True)
    assert record.to_json()["finish_reason"] == "length"


def test_report_table_prints_totals_and_finish_reasons():
    records = [_record(0, 8, 8), _record(1, 0, 8, None, "http_500")]
    run = {"label": "a", "figures": {"num_ok": 1, "errors": {"http_500": 1}}, "totals": totals(records, True)}
    lines = {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in report.table([run]).splitlines()[2:]}
    assert lines["requests sent"] == "2" and lines["requests failed"] == "1"
    assert lines["completion tokens"] == "8" and lines["expected tokens"] == "16"
    assert lines["exact"] == "NO" and lines["finish length"] == "1" and lines["finish none"] == "1"
    assert lines["http_500"] == "1"


def test_sustained_requests_are_deterministic_and_half_share_a_prefix():
    settings = workloads.resolve("w6", Settings(num_groups=3, prefix_len=20, input_len=10, output_len=6))
    assert (settings.num_groups, settings.prefix_len, settings.sigma) == (3, 20, 0.8)
    one, two = (workloads.Sustained(settings, IdPrompts(32000), seed=7) for _ in range(2))
    later_first = [two.request(i) for i in reversed(range(40))][::-1]  # any order: request i is a function of i
    specs = [one.request(i) for i in range(40)]
    assert [s.prompt for s in specs] == [s.prompt for s in later_first]
    assert [s.max_tokens for s in specs] == [s.max_tokens for s in later_first]
    for i, spec in enumerate(specs):
        assert spec.num_prompt_tokens == len(spec.prompt) and 1 <= spec.max_tokens <= 60
        assert (spec.prompt[:20] in one.prefixes) == (i % 2 == 0)
    assert len({tuple(s.prompt[:20]) for s in specs[::2]}) == 3
    assert one.request(1).prompt != workloads.Sustained(settings, IdPrompts(32000), seed=7, salt=1).request(1).prompt
    with pytest.raises(ValueError, match="closed loop"):
        workloads.build("sustained", settings, IdPrompts(32000), seed=0)


METRICS_TEXT = """# HELP radixserve_kv_cache_usage_perc fraction
# TYPE radixserve_kv_cache_usage_perc gauge
radixserve_kv_cache_usage_perc{worker_id="w0"} 0.25
radixserve_kv_cache_usage_perc{worker_id="w1"} 0.75
radixserve_num_requests_running{worker_id="w0"} 3.0
radixserve_num_requests_running{worker_id="w1"} 4.0
radixserve_prefix_cache_queries_total{worker_id="w0"} 100.0
radixserve_prefix_cache_queries_total{worker_id="w1"} 60.0
radixserve_prefix_cache_hits_total{worker_id="w0"} 40.0
radixserve_prefix_cache_hits_total{worker_id="w1"} 0.0
radixserve_prefix_cache_hits_created{worker_id="w0"} 1.7e+09
"""


def test_server_series_average_fractions_sum_the_rest_and_tolerate_absence():
    series = scrape.server_series(scrape.parse_samples(METRICS_TEXT))
    assert series == {"radixserve_kv_cache_usage_perc": 0.5, "radixserve_prefix_cache_usage_perc": None,
                      "radixserve_num_requests_running": 7.0, "radixserve_num_requests_waiting": None,
                      "radixserve_prefix_cache_queries_total": 160.0, "radixserve_prefix_cache_hits_total": 40.0,
                      "radixserve_num_preemptions_total": None}
    assert set(scrape.server_series({}).values()) == {None}


def _snapshot(t_s: float, tokens: int, finished: int, queries: float | None, hits: float | None,
              kv: float | None = None) -> timeline.Snapshot:
    server = {"radixserve_prefix_cache_queries_total": queries, "radixserve_prefix_cache_hits_total": hits,
              "radixserve_kv_cache_usage_perc": kv}
    return timeline.Snapshot(t_s, tokens, finished, 4, server)


def test_window_rows_rate_hits_and_missing_series():
    rows = timeline.rows([_snapshot(0.0, 0, 0, 100.0, 10.0), _snapshot(2.0, 50, 3, 300.0, 60.0, kv=0.5),
                          _snapshot(4.0, 90, 5, 300.0, 60.0), _snapshot(5.0, 100, 6, None, None)])
    assert rows[0] == {"t_start_s": 0.0, "t_end_s": 2.0, "num_output_tokens": 50, "output_tok_s": 25.0,
                       "num_finished": 3, "num_in_flight": 4, "kv_cache_usage_perc": 0.5,
                       "prefix_cache_usage_perc": None, "num_requests_running": None, "num_requests_waiting": None,
                       "prefix_cache_queries": 200.0, "prefix_cache_hits": 50.0, "num_preemptions": None,
                       "hit_rate": 0.25}
    assert (rows[1]["output_tok_s"], rows[1]["prefix_cache_queries"], rows[1]["hit_rate"]) == (20.0, 0.0, None)
    assert (rows[2]["prefix_cache_hits"], rows[2]["hit_rate"], rows[2]["output_tok_s"]) == (None, None, 10.0)


def _windows(rates: list[float], interval_s: float) -> list[dict]:
    return [{"t_start_s": i * interval_s, "t_end_s": (i + 1) * interval_s, "num_output_tokens": r * interval_s}
            for i, r in enumerate(rates)]


def test_steady_ratio_minute_windows_or_fifths():
    rates = [100.0] * 6 + [50.0] * 18 + [90.0] * 6  # 300 s of 10 s samples
    steady = timeline.steady(_windows(rates, 10.0), 300.0, 10.0)
    assert steady == {"steady_ratio": pytest.approx(0.9), "steady_basis": "first and last 60 s",
                      "steady_num_samples": 6, "first_output_tok_s": 100.0, "last_output_tok_s": 90.0}
    short = timeline.steady(_windows([10.0, 30.0, 40.0, 40.0, 60.0, 20.0], 1.0), 6.0, 1.0)
    assert (short["steady_num_samples"], short["steady_ratio"]) == (1, 2.0)
    assert short["steady_basis"].startswith("first and last 20 %")
    assert timeline.steady(_windows([20.0, 40.0] * 5, 10.0), 100.0, 10.0)["steady_num_samples"] == 2
    assert timeline.steady(_windows([20.0, 40.0] * 5, 10.0), 100.0, 10.0)["steady_ratio"] == 1.0
    assert timeline.steady([], 6.0, 1.0)["steady_ratio"] is None
    assert timeline.steady(_windows([0.0, 5.0], 1.0), 2.0, 1.0)["steady_ratio"] is None
