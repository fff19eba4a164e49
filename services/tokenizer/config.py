"""The tokenizer service's configuration."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenizerConfig:
    """radixserve tokenizer: chat templates, tokenizing and detokenizing between gateways and schedulers."""

    model: str = field(default="bundled", metadata={"help": "'bundled', an HF model directory, or random:<preset>"})
    tokenizer_addr: str = field(default="tcp://127.0.0.1:5550",
                                metadata={"help": "ROUTER bind address for gateways"})
    stream_addr: str = field(default="tcp://127.0.0.1:5551",
                             metadata={"help": "PULL bind address for TokenBatch / GenerateError"})
    scheduler_addrs: str = field(default="tcp://127.0.0.1:5560",
                                 metadata={"help": "comma-separated scheduler ROUTER addresses"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page (block hash granularity)"})
    max_model_len: int = field(
        default=0, metadata={"help": "context limit in tokens: a prompt plus max_tokens beyond it is refused with 400 "
                                     "context_length_exceeded (0: the model's, from its config; unknown for "
                                     "random:<preset>, whose workers check it)"})
    trust_message_special_tokens: bool = field(
        default=False, metadata={"help": "true: special tokens written in chat message contents stay special (a "
                                         "trusted deployment's opt-out). By default they are plain text, so no client "
                                         "can forge a role or end a turn: only the chat template's own are special"})
    max_requests: int = field(
        default=16384, metadata={"help": "requests in flight here; beyond, 429 with Retry-After. A memory guard, not "
                                         "a queue (the scheduler queues): the default admits a burst of 16,000"})
    scheduler_ping_interval_s: float = field(default=0.5,
                                             metadata={"help": "seconds between liveness pings to each scheduler"})
    scheduler_timeout_s: float = field(
        default=5.0, metadata={"help": "a scheduler silent this long is lost: new requests go to the others and "
                                       "its own are handed over or re-sent. Long enough for a busy one: a ping "
                                       "waits behind every message ahead of it on the scheduler's socket (a burst "
                                       "of 1,000 requests, each with a Redis lookup, kept one silent over 1 s). "
                                       "One whose socket is not connected is lost at once"})
    scheduler_give_up_s: float = field(
        default=30.0, metadata={"help": "with no other scheduler live, requests of a silent one wait this long for "
                                        "it to answer again before they fail with 503 (it may only be busy: if it "
                                        "answers as the same incarnation it still holds them, and nothing is "
                                        "re-sent)"})
    max_resends: int = field(
        default=1, metadata={"help": "times a request that streamed nothing yet is re-sent after its scheduler or "
                                     "worker died (0: never; it fails with 503)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})

    def __post_init__(self) -> None:
        if not 0 < self.scheduler_ping_interval_s < self.scheduler_timeout_s:
            raise ValueError("scheduler_ping_interval_s must be > 0 and shorter than scheduler_timeout_s")
        if self.scheduler_give_up_s < 0:
            raise ValueError("scheduler_give_up_s must be >= 0")
        if self.max_resends < 0 or self.max_requests < 1:
            raise ValueError("max_resends must be >= 0 and max_requests >= 1")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0 (0: the model's)")

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted (one token of the context left for the completion); 0: not known here."""
        return max(self.max_model_len - 1, 0)

    @property
    def scheduler_addr_list(self) -> list[str]:
        return [a.strip() for a in self.scheduler_addrs.split(",") if a.strip()]
