"""The engine's metrics core (fixed buckets, counters) and their Prometheus rendering in the scheduler."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gpu_worker.engine_metrics import EngineMetricsRecorder, Histogram
from services.scheduler.metrics import SchedulerMetrics
from shared.messages import EngineMetrics, HistogramCounts


def test_histogram_buckets_follow_prometheus_le() -> None:
    histogram = Histogram((1, 8, 16))
    for value in (0, 1, 1.5, 8, 9, 16, 17, 1000):
        histogram.observe(value)
    # (-inf, 1]: 0, 1 · (1, 8]: 1.5, 8 · (8, 16]: 9, 16 · above: 17, 1000
    assert histogram.counts == [2, 2, 2, 2]
    assert histogram.count == 8
    assert histogram.sum == 0 + 1 + 1.5 + 8 + 9 + 16 + 17 + 1000
    assert histogram.as_wire() == HistogramCounts([1, 8, 16], [2, 2, 2, 2], 1052.5)


def test_histogram_refuses_unsorted_bounds() -> None:
    with pytest.raises(ValueError):
        Histogram((1, 1, 2))
    with pytest.raises(ValueError):
        Histogram((2, 1))


def test_recorder_counts() -> None:
    recorder = EngineMetricsRecorder()
    recorder.on_first_admission(num_prompt_tokens=17, num_cached_tokens=12, queue_time_s=0.003)
    recorder.on_first_admission(num_prompt_tokens=5, num_cached_tokens=0, queue_time_s=-0.5)  # clock skew → 0
    recorder.on_step(num_tokens=22, num_sequences=2, step_time_s=0.0015)
    recorder.on_step(num_tokens=2, num_sequences=2, step_time_s=0.0007)
    recorder.on_generated(2)
    recorder.on_generated(0)
    assert (recorder.num_prompt_tokens, recorder.num_prefix_queries, recorder.num_prefix_hits) == (22, 22, 12)
    assert recorder.num_generation_tokens == 2
    assert recorder.queue_time_s.counts[:3] == [1, 0, 1]  # 0 ≤ 0.001 ; 0.003 in (0.0025, 0.005]
    assert recorder.queue_time_s.sum == pytest.approx(0.003)
    assert recorder.step_tokens.counts[:4] == [0, 1, 0, 1]  # 2 in (1, 8], 22 in (16, 32]
    assert recorder.step_sequences.counts[:3] == [0, 2, 0]  # 2 in (1, 2]
    assert recorder.step_time_s.counts[:4] == [0, 1, 1, 0]  # 0.0007 in (0.0005, 0.001], 0.0015 in (0.001, 0.002]
    assert recorder.step_time_s.count == recorder.step_tokens.count == recorder.step_sequences.count == 2


def _engine_metrics(num_preemptions: int, num_generation_tokens: int) -> EngineMetrics:
    histogram = HistogramCounts([1.0, 8.0], [1, 0, 2], 30.0)
    return EngineMetrics(num_requests_running=3, num_requests_waiting=1, num_total_pages=200, num_request_pages=50,
                         num_cached_pages=20, num_preemptions=num_preemptions, num_prefix_queries=100,
                         num_prefix_hits=40, num_prompt_tokens=100, num_generation_tokens=num_generation_tokens,
                         queue_time_s=histogram, step_time_s=histogram, step_tokens=histogram,
                         step_sequences=histogram)


def test_scheduler_renders_each_workers_engine_series() -> None:
    workers = [("w0", _engine_metrics(2, 70)), ("w1", _engine_metrics(0, 5))]
    text = SchedulerMetrics("cache_aware", lambda: workers).render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, worker_id: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"worker_id": worker_id, **labels}.items())))]

    assert value("radixserve_num_requests_running", "w0") == 3
    assert value("radixserve_num_requests_waiting", "w1") == 1
    assert value("radixserve_kv_cache_usage_perc", "w0") == 0.25
    assert value("radixserve_prefix_cache_usage_perc", "w0") == 0.1
    assert value("radixserve_num_preemptions_total", "w0") == 2
    assert value("radixserve_num_preemptions_total", "w1") == 0
    assert value("radixserve_prefix_cache_queries_total", "w0") == 100
    assert value("radixserve_prefix_cache_hits_total", "w0") == 40
    assert value("radixserve_prompt_tokens_total", "w1") == 100
    assert value("radixserve_generation_tokens_total", "w0") == 70
    assert value("radixserve_generation_tokens_total", "w1") == 5
    for name in ("radixserve_request_queue_time_seconds", "radixserve_engine_step_seconds",
                 "radixserve_iteration_tokens_total", "radixserve_engine_step_sequences"):
        assert [value(name + "_bucket", "w1", le=le) for le in ("1.0", "8.0", "+Inf")] == [1, 1, 3]  # cumulative
        assert value(name + "_count", "w1") == 3
        assert value(name + "_sum", "w1") == 30.0
    assert "radixserve_scheduler_routing_decisions" in text  # the scheduler's own series stay


def test_scheduler_without_workers_renders_no_engine_samples() -> None:
    text = SchedulerMetrics("cache_aware").render().decode()
    assert "worker_id" not in text
    assert "# TYPE radixserve_num_requests_running gauge" in text
