"""One API call in flight at the gateway: its generations (one per prompt), the queue their results share, and the
output they build; the gateway's handlers own the sockets."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import structlog

from services.gateway.protocol import ApiError
from services.gateway.responses import RequestOutput
from shared.messages import GenerateChunk, GenerateError

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Call:
    """One API call in flight: its generations (one per prompt, request_ids[p]), the queue their results share, what
    they produced so far, and the call's deadline (loop time)."""

    request_ids: list[str]
    queue: asyncio.Queue[GenerateChunk | GenerateError]
    output: RequestOutput
    deadline: float  # math.inf: none
    timeout_s: float  # 0: none
    num_sent: int = 0  # request_ids[:num_sent] went to a tokenizer
    failed: set[int] = field(default_factory=set)  # prompts whose generation failed (ended upstream)
    prompt_of: dict[str, int] = field(init=False)  # request id → its prompt's index

    def __post_init__(self) -> None:
        self.prompt_of = {rid: p for p, rid in enumerate(self.request_ids)}

    def open_request_ids(self) -> list[str]:
        """The generations sent and not ended: those to abort when the call ends early."""
        return [rid for p, rid in enumerate(self.request_ids[:self.num_sent])
                if p not in self.failed and not self.output.is_prompt_finished(p)]

    async def next_chunk(self) -> GenerateChunk:
        """The next chunk that extends a sample (folded into output, its index the choice's); ApiError on the failure
        of any prompt's generation, or on timeout."""
        while True:
            remaining_s = self.deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(self.queue.get(), max(remaining_s, 0.0) if self.timeout_s else None)
            except TimeoutError:
                raise ApiError(504, f"The request timed out after {self.timeout_s:g} s.", type="server_error",
                               code="timeout") from None
            prompt = self.prompt_of[msg.request_id]
            if isinstance(msg, GenerateError):
                self.failed.add(prompt)
                raise api_error(msg)
            if 0 <= msg.index < self.output.n:
                chunk = msgspec.structs.replace(msg, index=prompt * self.output.n + msg.index) if prompt else msg
                if self.output.add(chunk):
                    return chunk
            log.warning("dropped chunk with a bad or finished index", request_id=msg.request_id, index=msg.index)


# The error code of a GenerateError that names none (a lost worker or scheduler, an engine failure): clients
# branch on `code`, so an error event mid-stream never carries null
STATUS_ERROR_CODES = {429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable", 504: "timeout"}


def api_error(msg: GenerateError) -> ApiError:
    code = msg.error_code or STATUS_ERROR_CODES.get(msg.status)
    return ApiError(msg.status, msg.message, type=msg.code, param=msg.param, code=code,
                    retry_after_s=msg.retry_after_s)
