"""The engine's metrics on a tiny random model, in both step modes: prefix-cache queries and hits counted once per
sequence (not again after a preemption), generated tokens, the per-step histograms, and the heartbeat snapshot."""
from __future__ import annotations

import time
from bisect import bisect_left

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.engine_loop import engine_metrics
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - step_mode: autouse, both modes

PAGE = 4
SHARED = list(range(100, 112))  # 12 tokens: 3 full pages


def _engine(num_pages: int, **overrides: object) -> Engine:
    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=num_pages,
                          page_size=PAGE, enable_overlap=MODE["overlap"], **overrides)
    return Engine(config, loaded=load_model("random:tiny-llama", dtype=torch.float32, seed=1))


def _record_plans(engine: Engine) -> list[tuple[int, int]]:
    """(tokens, sequences) of every plan the policy makes from now on."""
    plans: list[tuple[int, int]] = []
    schedule = engine.policy.schedule

    def recording(now: float):
        plan = schedule(now)
        if plan.items:
            plans.append((plan.num_tokens, len(plan.items)))
        return plan

    engine.policy.schedule = recording
    return plans


def _bucket_counts(bounds: list[float], values: list[float]) -> list[int]:
    counts = [0] * (len(bounds) + 1)
    for value in values:
        counts[bisect_left(bounds, value)] += 1
    return counts


@pytest.mark.slow
def test_counters_with_a_shared_prefix_and_preemption() -> None:
    engine = _engine(num_pages=21)  # 20 usable pages: two 57-token sequences (15 pages each, 3 shared) do not fit
    plans = _record_plans(engine)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.generate([SHARED + [1, 2, 3, 4]], greedy)  # caches the shared 3 pages (and a 4th)
    assert first[0].num_cached_tokens == 0
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = engine.generate([SHARED + [5, 6, 7, 8, 9], SHARED + [10, 11, 12, 13, 14]], long)
    assert engine.policy.num_preemptions > 0

    recorder = engine.metrics
    assert recorder.num_prefix_queries == recorder.num_prompt_tokens == 16 + 17 + 17
    assert recorder.num_prefix_hits == 12 + 12 == sum(r.num_cached_tokens for r in results)
    assert recorder.num_generation_tokens == 4 + 40 + 40
    assert recorder.queue_time_s.count == 3
    num_steps = engine.stats().num_steps
    assert len(plans) == num_steps
    assert recorder.step_time_s.count == recorder.step_tokens.count == recorder.step_sequences.count == num_steps
    tokens, sequences = [t for t, _ in plans], [s for _, s in plans]
    assert recorder.step_tokens.counts == _bucket_counts(list(recorder.step_tokens.bounds), tokens)
    assert recorder.step_tokens.sum == sum(tokens)
    assert recorder.step_sequences.counts == _bucket_counts(list(recorder.step_sequences.bounds), sequences)
    assert recorder.step_sequences.sum == sum(sequences)

    snapshot = engine_metrics(engine)
    assert snapshot.num_preemptions == engine.policy.num_preemptions
    assert (snapshot.num_prefix_queries, snapshot.num_prefix_hits, snapshot.num_generation_tokens) == (50, 24, 84)
    assert (snapshot.num_requests_running, snapshot.num_requests_waiting) == (0, 0)
    assert snapshot.num_total_pages == 20
    assert snapshot.num_request_pages == 0  # idle: every page is free or only cached (evictable)
    assert snapshot.num_cached_pages == engine.cache.num_cached_pages > 0
    assert snapshot.step_tokens.counts == recorder.step_tokens.counts


@pytest.mark.slow
def test_a_sequence_preempted_during_its_prefill_counts_once() -> None:
    engine = _engine(num_pages=11, max_num_batched_tokens=8)  # 10 pages; prompts prefilled in chunks
    victims: list[int] = []  # output tokens of each preempted sequence
    preempt = engine.policy.preempt
    engine.policy.preempt = lambda seq, now: victims.append(seq.num_output_tokens) or preempt(seq, now)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = engine.generate([list(range(1, 17)), list(range(200, 224))], greedy)
    assert 0 in victims  # a sequence lost its pages before its first token, and was admitted again
    recorder = engine.metrics
    assert recorder.num_prefix_queries == recorder.num_prompt_tokens == 16 + 24
    assert recorder.num_prefix_hits == 0 == sum(r.num_cached_tokens for r in results)  # not its own pages, later
    assert recorder.queue_time_s.count == 2
    # 10 pages hold 40 tokens, the most one sequence may reach: the 24-token prompt gets 16 output tokens
    assert recorder.num_generation_tokens == sum(len(r.samples[0].token_ids) for r in results) == 24 + 16


def test_gauges_while_running_and_queue_time_from_arrival() -> None:
    engine = _engine(num_pages=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 10)), params, arrival_s=time.time() - 1000.0)  # waited 1000 s upstream
    engine.add_request("b", list(range(20, 30)), params)
    waiting = engine_metrics(engine)
    assert (waiting.num_requests_running, waiting.num_requests_waiting, waiting.num_request_pages) == (0, 2, 0)
    engine.step()
    running = engine_metrics(engine)
    assert (running.num_requests_running, running.num_requests_waiting) == (2, 0)
    assert running.num_request_pages == 3 + 3  # 9 and 10 prompt tokens: 3 pages each, held by their requests
    queue = engine.metrics.queue_time_s
    assert queue.count == 2
    assert queue.counts[-1] == 1  # "a": above the last bound (600 s)
    assert queue.sum >= 1000.0
