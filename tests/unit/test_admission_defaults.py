"""The admission limits' defaults (issue 24): a burst of 5,000 requests of 1,000-token prompts is admitted by
every limit in front of the scheduler's queue and held by that queue, and nothing fails for having waited."""
from __future__ import annotations

from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig

BURST_REQUESTS, PROMPT_TOKENS = 5000, 1000


def test_a_5000_request_burst_is_admitted_everywhere_and_has_no_time_limit() -> None:
    gateway, tokenizer, scheduler = GatewayConfig(), TokenizerConfig(), SchedulerConfig()
    assert (gateway.max_concurrent_requests, tokenizer.max_requests, scheduler.max_queue) == (16384, 16384, 16384)
    assert scheduler.max_queued_tokens == 1 << 24 >= BURST_REQUESTS * PROMPT_TOKENS
    assert (gateway.request_timeout_s, scheduler.max_queue_wait_s) == (0.0, 0.0)  # 0: no limit
