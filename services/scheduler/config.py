"""The scheduler service's one frozen config (CLI flags / RADIXSERVE_* env)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.pairing import PD_POLICIES
from services.scheduler.policy import POLICIES, CostWeights
from shared.config import check_fields

AUTO_REQUESTS_PER_SEQ = 2  # auto per-worker limit: the worker's running batch and one more wave in its own queue
FALLBACK_REQUESTS_PER_WORKER = 512  # auto, for a worker that reports no max_num_seqs (an older worker)


@dataclass(frozen=True)
class SchedulerConfig:
    """radixserve scheduler: admits tokenized requests and routes each to a live worker."""

    scheduler_addr: str = field(default="tcp://127.0.0.1:5560",
                                metadata={"help": "ROUTER bind address (tokenizers, workers, gateways)"})
    redis_url: str = field(default="", metadata={"help": "Redis of the global prefix index (empty: no lookups)"})
    cache_index_addr: str = field(default="",
                                  metadata={"help": "cache_index PULL address told of dead workers (empty: none)"})
    max_queue: int = field(
        default=16384, metadata={"help": "requests held while no worker can take one (beyond: 429 with Retry-After). "
                                         "A queued request waits until a worker takes it, its client goes away or "
                                         "its own deadline passes (504); the default admits a burst of 16,000 "
                                         "requests, max_queued_tokens permitting"})
    max_queued_tokens: int = field(
        default=1 << 24, metadata={"help": "prompt tokens held by the queue (beyond: 429 with Retry-After). The "
                                           "queue's memory bound: a queued token costs ~40 bytes here (Python ints), "
                                           "so the default 16M (16384 prompts of 1024 tokens) is at most ~0.7 GB"})
    max_queue_wait_s: float = field(
        default=0.0, metadata={"help": "longest a request waits in the queue before it fails with 503 (0, the "
                                       "default: no limit; for operators who prefer failing fast to waiting)"})
    max_requests_per_worker: int = field(
        default=0, metadata={"help": "requests in flight on one worker; beyond, requests wait in the queue. 0 "
                                     "(auto): 2 × the max_num_seqs the worker reports (its running batch plus a "
                                     f"second wave ready in its own queue; {FALLBACK_REQUESTS_PER_WORKER} if it "
                                     "reports none); a positive value is a fixed limit"})
    heartbeat_timeout_s: float = field(default=3.0,
                                       metadata={"help": "a worker silent this long is dead (its requests get 503)"})
    abort_memory_s: float = field(
        default=10.0, metadata={"help": "seconds the abort or end of a request unknown here is remembered, so the "
                                        "request is not taken on if a tokenizer hands it over from a dead "
                                        "scheduler (0: off)"})
    routing: str = field(default="cache_aware", metadata={"help": "how the scheduler picks a worker for each request",
                                                         "choices": POLICIES})
    route_request_tokens: float = field(
        default=64.0, metadata={"help": "cache_aware: cost, in prompt tokens, of each active request on a worker"})
    route_kv_tokens: float = field(
        default=64.0, metadata={"help": "cache_aware: cost, in prompt tokens, of a worker's full KV pool"})
    max_imbalance_ratio: float = field(
        default=1.5, metadata={"help": "cache_aware: a worker with more than ratio × min + requests active "
                                       "requests (min over the workers) gets none by affinity"})
    max_imbalance_requests: int = field(default=4, metadata={"help": "cache_aware: the `requests` of that bound"})
    pending_ttl_s: float = field(
        default=5.0, metadata={"help": "seconds a routed prompt's blocks count as held by its worker before "
                                       "the index shows them (0: off)"})
    redis_timeout_s: float = field(default=0.05, metadata={
        "help": "prefix lookup budget's floor; it adapts to 4 × recent p90 latency (CPU load included) up to the max"})
    redis_timeout_max_s: float = field(default=0.5, metadata={
        "help": "longest a prefix lookup may ever take (at least redis_timeout_s)"})
    redis_retry_s: float = field(default=5.0,
                                 metadata={"help": "after a Redis error, seconds of load-only routing before retrying"})
    pd_policy: str = field(default="auto", metadata={
        "help": "with prefill workers up: split every request (always), none (never), or long uncached ones (auto)",
        "choices": PD_POLICIES})
    pd_min_prefill_tokens: int = field(
        default=256, metadata={"help": "pd auto: split a request when its decode/mixed worker would prefill at "
                                       "least this many uncached tokens"})
    metrics_host: str = field(default="0.0.0.0", metadata={"help": "bind host of the /metrics endpoint"})
    metrics_port: int = field(default=0, metadata={"help": "HTTP port of Prometheus /metrics (0: off)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def __post_init__(self) -> None:
        check_fields(self)
        if min(self.max_queue, self.max_queued_tokens, self.max_requests_per_worker) < 0:
            raise ValueError("max_queue, max_queued_tokens and max_requests_per_worker must be >= 0")
        if min(self.heartbeat_timeout_s, self.redis_timeout_s, self.redis_retry_s) <= 0:
            raise ValueError("heartbeat_timeout_s, redis_timeout_s, redis_retry_s must be > 0")
        if self.max_queue_wait_s < 0:
            raise ValueError("max_queue_wait_s must be >= 0 (0: no limit)")
        if self.pd_min_prefill_tokens < 0:
            raise ValueError("pd_min_prefill_tokens must be >= 0")
        if self.max_imbalance_ratio < 1 or self.max_imbalance_requests < 0:
            raise ValueError("max_imbalance_ratio must be >= 1 and max_imbalance_requests >= 0")
        if min(self.route_request_tokens, self.route_kv_tokens, self.pending_ttl_s, self.abort_memory_s) < 0:
            raise ValueError("route_request_tokens, route_kv_tokens, pending_ttl_s and abort_memory_s must be >= 0")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError("metrics_port must be 0 (off) or a TCP port")

    def requests_per_worker(self, max_num_seqs: int) -> int:
        """The in-flight limit of a worker that reports max_num_seqs (0: reports none)."""
        if self.max_requests_per_worker:
            return self.max_requests_per_worker
        return AUTO_REQUESTS_PER_SEQ * max_num_seqs if max_num_seqs > 0 else FALLBACK_REQUESTS_PER_WORKER

    @property
    def cost_weights(self) -> CostWeights:
        return CostWeights(self.route_request_tokens, self.route_kv_tokens, self.max_imbalance_ratio,
                           self.max_imbalance_requests)
