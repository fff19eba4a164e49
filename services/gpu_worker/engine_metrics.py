"""The engine's cumulative counters and fixed-bucket histograms (vLLM's engine metrics), kept per step at O(1) cost.

Pure core: no clocks, no Prometheus; the engine passes values in, and the worker sends a copy (as_wire) in its
heartbeats. Histogram counts are per bucket, not cumulative: counts[i] holds the values in
(bounds[i-1], bounds[i]], and counts[-1] those above the last bound (Prometheus' `le` semantics).
"""
from __future__ import annotations

from bisect import bisect_left

from shared.messages import HistogramCounts

QUEUE_TIME_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                       120.0, 300.0, 600.0)
STEP_TIME_BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
STEP_TOKENS_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's iteration_tokens
STEP_SEQUENCES_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Histogram:
    """Observations counted into fixed buckets: one bisect per observation."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket: above every bound (+Inf)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def as_wire(self) -> HistogramCounts:
        return HistogramCounts(list(self.bounds), list(self.counts), self.sum)


class EngineMetricsRecorder:
    """Counters since the engine started (warm-up excluded) and the per-step histograms.

    A sequence counts once, at its first admission from the waiting queue (not again after a preemption):
    its prompt tokens are prefix-cache queries, the tokens its cache match served are hits, and the time from
    its request's arrival to then is its queue time. n > 1 siblings forked from a running parent share its one
    prompt pass and count nothing here; PD-imported prompts count on their prefill worker.
    """

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # speculative decoding (vLLM's spec_decode_*): rows verified with at least one draft, their drafts, and how
        # many of those the target accepted; mean accepted length per drafted row = 1 + accepted / drafts
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.queue_time_s = Histogram(QUEUE_TIME_BOUNDS_S)
        self.step_time_s = Histogram(STEP_TIME_BOUNDS_S)
        self.step_tokens = Histogram(STEP_TOKENS_BOUNDS)
        self.step_sequences = Histogram(STEP_SEQUENCES_BOUNDS)

    def on_first_admission(self, num_prompt_tokens: int, num_cached_tokens: int, queue_time_s: float) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.num_prefix_queries += num_prompt_tokens
        self.num_prefix_hits += num_cached_tokens
        self.queue_time_s.observe(max(queue_time_s, 0.0))

    def on_step(self, num_tokens: int, num_sequences: int, step_time_s: float) -> None:
        """One engine step that ran a batch of num_sequences sequences, num_tokens tokens in all."""
        self.step_tokens.observe(num_tokens)
        self.step_sequences.observe(num_sequences)
        self.step_time_s.observe(step_time_s)

    def on_spec_verified(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's drafts verified in a step: num_accepted of its num_draft_tokens were kept."""
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_draft_tokens
        self.num_spec_accepted_tokens += num_accepted

    def on_generated(self, num_tokens: int) -> None:
        self.num_generation_tokens += num_tokens
