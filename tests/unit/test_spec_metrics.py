"""Speculative decoding's counters: counted by the engine, carried by the heartbeat's EngineMetrics, and rendered
by the scheduler as radixserve_spec_decode_* (vLLM's spec_decode_* series)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.gpu_worker.engine_loop import engine_metrics
from services.gpu_worker.request import SamplingParams
from services.scheduler.metrics import SchedulerMetrics
from tests.unit.test_spec_engine import _engine, _prompts, _replay


def test_drafts_and_accepted_tokens_are_counted_and_exported() -> None:
    prompt = _prompts(num=1)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _engine(enable_overlap=False).generate([prompt], params)[0].samples[0].token_ids
    engine = _engine(enable_overlap=False, speculative_method="ngram", num_speculative_tokens=5)
    engine.speculator.proposer = _replay({tuple(prompt): want}, alpha=1.0)
    assert engine.generate([prompt], params)[0].samples[0].token_ids == want
    # prefill gives token 1; then (adaptive.py, CPU costs: each draft worth more than 0.3 of a token) 2 drafts + 1,
    # 4 drafts + 1 once all were accepted, then 2 drafts (max_tokens leaves 3) + 1
    snapshot = engine_metrics(engine)
    assert (snapshot.num_spec_drafts, snapshot.num_spec_draft_tokens, snapshot.num_spec_accepted_tokens) == (3, 8, 8)
    assert snapshot.num_generation_tokens == 12
    assert engine.stats().num_steps == 4

    text = SchedulerMetrics("cache_aware", lambda: [("w0", snapshot)]).render().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.labels.get("worker_id") == "w0"}
    assert samples["radixserve_spec_decode_num_drafts_total"] == 3
    assert samples["radixserve_spec_decode_num_draft_tokens_total"] == 8
    assert samples["radixserve_spec_decode_num_accepted_tokens_total"] == 8
