"""radixserve bench arithmetic: exact percentiles, TPOT/ITL from scripted timestamps, goodput, workloads."""
from __future__ import annotations

import math

import numpy as np
import pytest

from radixserve.bench import workloads
from radixserve.bench.client import StreamTimer
from radixserve.bench.metrics import RequestRecord, latency_stats, meets_slo, percentile, summarize
from radixserve.bench.workloads import IdPrompts, Settings, TextPrompts


def test_percentile_is_linear_interpolation_between_ranks():
    values = [0.1, 0.2, 0.3, 0.4, 1.0]
    assert percentile(values, 50) == pytest.approx(0.3)
    assert percentile(values, 90) == pytest.approx(0.76)  # rank 3.6: 0.4 + 0.6 * (1.0 - 0.4)
    assert percentile(values, 99) == pytest.approx(0.976)  # rank 3.96
    assert percentile([5.0], 99) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)  # unsorted input


def test_latency_stats_in_milliseconds():
    stats = latency_stats([0.01, 0.02, 0.03, 0.04])
    assert stats == pytest.approx({"mean_ms": 25.0, "p50_ms": 25.0, "p90_ms": 37.0, "p99_ms": 39.7})
    assert latency_stats([]) == {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}


def _timed(started: float, events: list[tuple[float, str]]) -> RequestRecord:
    """A RequestRecord from (arrival time, SSE text) pairs fed to the client's StreamTimer."""
    timer = StreamTimer(started)
    for at, text in events:
        timer.feed(text.encode(), at)
    timer.close(events[-1][0])
    record = RequestRecord(0, max_tokens=4)
    timer.fill(record)
    return record


def _chunk(text: str) -> str:
    return f'data: {{"choices": [{{"index": 0, "text": "{text}", "finish_reason": null}}]}}\n\n'


def test_ttft_itl_tpot_e2e_from_scripted_timestamps():
    usage = ('data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, '
             '"prompt_tokens_details": {"cached_tokens": 3}}}\n\n')
    record = _timed(10.0, [(10.05, _chunk("a")), (10.06, _chunk("b")), (10.08, _chunk("")),
                           (10.09, _chunk("c")), (10.12, _chunk("d")), (10.12, usage), (10.13, "data: [DONE]\n\n")])
    assert record.is_ok
    assert record.ttft_s == pytest.approx(0.05)
    assert record.itl_s == pytest.approx([0.01, 0.03, 0.03])  # the empty chunk is no token
    assert record.e2e_s == pytest.approx(0.13)
    assert record.tpot_s == pytest.approx((0.13 - 0.05) / 3)
    assert (record.num_prompt_tokens, record.num_output_tokens, record.num_cached_tokens) == (7, 4, 3)


def test_counts_chunks_without_usage_and_flags_truncated_streams():
    record = _timed(0.0, [(0.5, _chunk("a")), (0.7, _chunk("b"))])
    assert record.error_kind == "incomplete_stream"
    assert record.num_output_tokens == 2 and record.num_cached_tokens is None
    record = _timed(0.0, [(0.5, _chunk("a")), (0.6, 'data: {"error": {"message": "boom", "code": 500}}\n\n')])
    assert (record.error_kind, record.error_message) == ("stream_error", "boom")


def _record(index: int, ttft: float, e2e: float, out: int, error: str | None = None, prompt: int = 10,
            cached: int | None = None) -> RequestRecord:
    return RequestRecord(index, ttft_s=ttft, e2e_s=e2e, num_output_tokens=out, max_tokens=out, error_kind=error,
                         num_prompt_tokens=prompt, num_cached_tokens=cached, itl_s=[(e2e - ttft) / max(out - 1, 1)] * (out - 1))


def test_summarize_throughput_goodput_errors_and_hit_rate():
    records = [_record(0, 0.1, 1.1, 11, cached=5), _record(1, 0.3, 1.3, 11, cached=0),
               _record(2, 0.1, 2.1, 11, cached=10), _record(3, 0.0, 0.0, 0, error="http_429"),
               _record(4, 0.0, 0.0, 0, error="http_429"), _record(5, 0.0, 0.0, 0, error="stream_error")]
    figures = summarize(records, duration_s=4.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (figures["num_ok"], figures["num_errors"]) == (3, 3)
    assert figures["errors"] == {"http_429": 2, "stream_error": 1}
    assert figures["request_throughput"] == pytest.approx(0.75)
    assert figures["input_tok_s"] == pytest.approx(7.5) and figures["output_tok_s"] == pytest.approx(8.25)
    # TPOTs 0.1, 0.1, 0.2 s; TTFTs 0.1, 0.3, 0.1 s: only request 0 meets both
    assert figures["num_good"] == 1 and figures["goodput"] == pytest.approx(0.25)
    assert figures["tpot"]["p50_ms"] == pytest.approx(100.0)
    assert figures["ttft"]["p90_ms"] == pytest.approx(260.0)
    assert figures["cache_hit_rate"] == pytest.approx(15 / 30)
    assert summarize(records, 4.0)["goodput"] is None  # no SLO given


def test_meets_slo_edges():
    one_token = _record(0, 0.1, 0.1, 1)
    assert one_token.tpot_s is None and meets_slo(one_token, 100, 1)  # no TPOT to miss
    assert not meets_slo(_record(0, 0.1001, 1.0, 5), 100, None)
    assert not meets_slo(_record(0, 0.0, 0.0, 0, error="timeout"), None, None)


def test_id_prompts_have_exact_lengths_and_shared_prefixes():
    settings = workloads.resolve("w2", Settings(num_groups=3, per_group=4, prefix_len=64, input_len=8, output_len=5))
    shared = workloads.build("w2", settings, IdPrompts(32000), seed=1)
    assert [len(r.prompt) for r in shared.requests] == [72] * 12
    assert all(r.max_tokens == 5 and r.num_prompt_tokens == 72 for r in shared.requests)
    assert len({tuple(r.prompt[:64]) for r in shared.requests}) == 3
    assert len({tuple(r.prompt[:64]) for r in shared.requests[:4]}) == 1
    random_ = workloads.build("w2", Settings(**{**settings.__dict__, "variant": "random"}), IdPrompts(32000), seed=1)
    assert len({tuple(r.prompt[:64]) for r in random_.requests}) == 12
    again = workloads.build("w2", settings, IdPrompts(32000), seed=1)
    assert [r.prompt for r in again.requests] == [r.prompt for r in shared.requests]
    other = workloads.build("w2", settings, IdPrompts(32000), seed=1, salt=1)
    assert other.requests[0].prompt != shared.requests[0].prompt


def test_w3_lengths_are_seeded_log_normal_and_salt_keeps_them():
    settings = workloads.resolve("w3", Settings(num_requests=2000))
    a = workloads.build("w3", settings, IdPrompts(32000), seed=7)
    b = workloads.build("w3", settings, IdPrompts(32000), seed=7, salt=3)
    ins = np.array([len(r.prompt) for r in a.requests])
    outs = np.array([r.max_tokens for r in a.requests])
    assert ins.tolist() == [len(r.prompt) for r in b.requests]  # same lengths, other contents
    assert a.requests[0].prompt != b.requests[0].prompt
    assert 225 < ins.mean() < 275 and 180 < outs.mean() < 220
    assert np.median(ins) < ins.mean()  # long right tail
    assert ins.min() >= 1 and ins.max() <= 2500 and ins.max() > 3 * 250


def test_w4_and_w5_shapes():
    s4 = workloads.resolve("w4", Settings(num_requests=200, long_input_len=100, input_len=10, long_fraction=0.25))
    w4 = workloads.build("w4", s4, IdPrompts(32000), seed=0)
    lengths = [len(r.prompt) for r in w4.requests]
    assert set(lengths) == {10, 100} and 30 < lengths.count(100) < 70
    s5 = workloads.resolve("w5", Settings(num_sessions=3, turns=5, prefix_len=16, input_len=4, output_len=2))
    w5 = workloads.build("w5", s5, IdPrompts(32000), seed=0)
    assert w5.num_requests == 15
    assert all(s.system == w5.sessions[0].system and len(s.system) == 16 for s in w5.sessions)
    assert all(len(u) == 4 for s in w5.sessions for u in s.user_turns)
    assert all(len(a) == 2 for s in w5.sessions for a in s.answer_standins)


def test_poisson_schedule_is_deterministic_with_the_right_mean():
    a = workloads.arrival_times(5001, rate=4.0, seed=3)
    assert a == workloads.arrival_times(5001, rate=4.0, seed=3)
    assert a != workloads.arrival_times(5001, rate=4.0, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.08)  # exponential: std = mean
    assert workloads.arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    assert workloads.arrival_times(3, 2.0, 0, "uniform") == [0.0, 0.5, 1.0]


def test_trace_replay(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 12.5, "prompt_ids": [1, 2, 3], "max_tokens": 4}\n\n'
                    '{"timestamp": 10.0, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n'
                    '{"timestamp": 11.0, "prompt": "hello", "max_tokens": 1}\n')
    trace = workloads.load_trace(path)
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0, 2.5]
    assert trace.requests[0].messages == [{"role": "user", "content": "hi"}]
    assert trace.requests[2].prompt == [1, 2, 3] and trace.requests[2].num_prompt_tokens == 3


@pytest.fixture(scope="module")
def bundled_tokenizer():
    from services.tokenizer.model_files import load_tokenizer
    try:
        return load_tokenizer("bundled")
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"bundled tokenizer unavailable: {exc}")


def test_text_prompts_re_encode_to_exact_lengths(bundled_tokenizer):
    maker = TextPrompts(bundled_tokenizer)
    settings = workloads.resolve("w2", Settings(num_groups=2, per_group=3, prefix_len=100, input_len=17, output_len=3))
    work = workloads.build("w2", settings, maker, seed=0)
    for request in work.requests:
        assert len(bundled_tokenizer.encode(request.prompt, add_special_tokens=False)) == 117
    assert work.requests[0].prompt[:200] == work.requests[2].prompt[:200]
    chat = workloads.build("w2", settings, maker, seed=0, is_chat=True)
    system, user = chat.requests[0].messages
    assert system["role"] == "system" and user["role"] == "user"
    assert len(bundled_tokenizer.encode(system["content"], add_special_tokens=False)) == 100
    assert len(bundled_tokenizer.encode(user["content"], add_special_tokens=False)) == 17
