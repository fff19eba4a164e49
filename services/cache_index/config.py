"""The cache_index service's one frozen config (CLI flags / RADIXSERVE_* env)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheIndexConfig:
    """radixserve cache_index: applies workers' KV events to the global prefix index in Redis."""

    cache_index_addr: str = field(default="tcp://127.0.0.1:5580",
                                  metadata={"help": "PULL bind address for KVEventBatch/CacheSnapshot/WorkerGone"})
    redis_url: str = field(default="redis://127.0.0.1:6379/0",
                           metadata={"help": "Redis holding the index (redis://host:port/db or unix:///path)"})
    retry_interval_s: float = field(default=1.0,
                                    metadata={"help": "seconds between retries of failed writes and snapshots"})
    redis_timeout_s: float = field(default=2.0, metadata={"help": "socket timeout of each Redis call"})
    max_buffered_batches: int = field(default=1024,
                                      metadata={"help": "event batches kept per worker while awaiting a snapshot"})
    gc_batch_blocks: int = field(default=1000, metadata={
        "help": "index entries of cleared workers removed per Redis call (each call stalls Redis ~1 ms per 1000)"})
    gc_pause_s: float = field(default=0.002, metadata={"help": "pause between two garbage-collection calls"})
    gc_interval_s: float = field(default=0.5, metadata={"help": "seconds between checks for garbage to collect"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def __post_init__(self) -> None:
        if self.retry_interval_s <= 0 or self.redis_timeout_s <= 0:
            raise ValueError("retry_interval_s and redis_timeout_s must be > 0")
        if self.max_buffered_batches < 1:
            raise ValueError("max_buffered_batches must be >= 1")
        if self.gc_batch_blocks < 1 or self.gc_pause_s < 0 or self.gc_interval_s <= 0:
            raise ValueError("gc_batch_blocks must be >= 1, gc_pause_s >= 0 and gc_interval_s > 0")
