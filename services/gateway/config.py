"""The gateway's one frozen config: HTTP listener, peer addresses, auth keys and request limits."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.tool_calls import TOOL_CALL_PARSERS


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class GatewayConfig:
    """OpenAI-compatible HTTP gateway (python -m services.gateway)."""

    host: str = field(default="0.0.0.0", metadata=_help("HTTP listen host"))
    port: int = field(default=8000, metadata=_help("HTTP listen port"))
    tokenizer_addrs: str = field(default="tcp://127.0.0.1:5550", metadata=_help("comma-separated tokenizer ROUTERs"))
    scheduler_addrs: str = field(default="tcp://127.0.0.1:5560", metadata=_help("comma-separated scheduler ROUTERs"))
    model_id: str = field(default="", metadata=_help("served model id; empty: learned from the scheduler"))
    api_keys: str = field(default="", metadata=_help("comma-separated accepted Bearer keys; empty: no auth"))
    max_body_bytes: int = field(default=4 << 20, metadata=_help("largest accepted request body"))
    request_timeout_s: float = field(
        default=0.0, metadata=_help("end-to-end limit of one request, queueing included: past it, 504 (0, the "
                                    "default: none; a request then ends when it finishes, its client goes away or "
                                    "the scheduler's queue refuses it)"))
    max_concurrent_requests: int = field(
        default=16384, metadata=_help("generations in flight here; beyond → 429 with Retry-After. A memory guard, "
                                      "not a queue: the scheduler queues; the default admits a burst of 16,000"))
    default_chat_max_tokens: int = field(default=1024, metadata=_help("chat max_tokens when the body has none"))
    drain_timeout_s: float = field(default=30.0, metadata=_help("on SIGTERM, seconds in-flight requests may take "
                                                                "to finish (new ones get 503) before the gateway "
                                                                "fails them and stops"))
    peer_timeout_s: float = field(default=2.0, metadata=_help("wait for a peer to take a message or answer status"))
    tokenize_timeout_s: float = field(default=30.0, metadata=_help("wait for a tokenizer's answer to /tokenize, "
                                                                   "/detokenize or an echoed prompt's text"))
    status_cache_s: float = field(default=0.5, metadata=_help("reuse a StatusReply this long"))
    tokenizer_ping_s: float = field(default=0.5, metadata=_help("ask the tokenizers, in turn, which requests they hold "
                                                                 "this often (0: never, and none is declared lost)"))
    tokenizer_silent_s: float = field(default=30.0, metadata=_help(
        "forget a tokenizer that has not answered a ping this long: its requests are lost unless another holds them "
        "(a restarted tokenizer is known at once by its new incarnation)"))
    tool_call_parser: str = field(default="auto", metadata={**_help(
        "how chat outputs become tool_calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen, the fallback "
        "prompt), llama3_json ({\"name\": ..., \"parameters\": ...}: Llama 3.x), mistral ([TOOL_CALLS] and a "
        "JSON array of {\"name\": ..., \"arguments\": ...}: Mistral, Mixtral, Mistral Nemo) or auto (all three, told "
        "apart by the output); tool_choice required or a named function is enforced with a grammar of this format"),
        "choices": TOOL_CALL_PARSERS})
    log_level: str = field(default="info", metadata=_help("debug, info, warning or error"))

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"not {self.tool_call_parser!r}")

    @property
    def tokenizer_addr_list(self) -> list[str]:
        return _split(self.tokenizer_addrs)

    @property
    def scheduler_addr_list(self) -> list[str]:
        return _split(self.scheduler_addrs)

    @property
    def api_key_list(self) -> list[str]:
        return _split(self.api_keys)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
