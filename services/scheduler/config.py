"""The scheduler service's one frozen config (CLI flags / RADIXSERVE_* env)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.policy import POLICIES


@dataclass(frozen=True)
class SchedulerConfig:
    """radixserve scheduler: admits tokenized requests and routes each to a live worker."""

    scheduler_addr: str = field(default="tcp://127.0.0.1:5560",
                                metadata={"help": "ROUTER bind address (tokenizers, workers, gateways)"})
    redis_url: str = field(default="", metadata={"help": "Redis of the global prefix index (empty: no lookups)"})
    cache_index_addr: str = field(default="",
                                  metadata={"help": "cache_index PULL address told of dead workers (empty: none)"})
    max_queue: int = field(default=1024, metadata={"help": "requests held while no worker is up (beyond: 429)"})
    max_queue_wait_s: float = field(default=30.0,
                                    metadata={"help": "longest a request waits for a worker (then 503)"})
    heartbeat_timeout_s: float = field(default=3.0,
                                       metadata={"help": "a worker silent this long is dead (its requests get 503)"})
    routing: str = field(default="least_load", metadata={"help": "routing policy: " + ", ".join(POLICIES)})
    redis_timeout_s: float = field(default=0.05, metadata={"help": "longest a prefix lookup may take"})
    redis_retry_s: float = field(default=5.0,
                                 metadata={"help": "after a Redis error, seconds of load-only routing before retrying"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def __post_init__(self) -> None:
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, not {self.routing!r}")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if min(self.heartbeat_timeout_s, self.max_queue_wait_s, self.redis_timeout_s, self.redis_retry_s) <= 0:
            raise ValueError("heartbeat_timeout_s, max_queue_wait_s, redis_timeout_s, redis_retry_s must be > 0")
