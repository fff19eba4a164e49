"""One streamed request against an OpenAI-compatible server, timed chunk by chunk into a RequestRecord."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from radixserve.bench.metrics import RequestRecord
from radixserve.bench.sse import EventKind, SseParser, interpret, usage_counts
from radixserve.bench.workloads import RequestSpec


@dataclass(frozen=True)
class Target:
    base_url: str  # up to and excluding /v1
    model: str
    is_chat: bool = False
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str = ""
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.is_chat else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    """stream=true with usage; max_tokens exact and (by default) ignore_eos so output lengths are exact."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": spec.max_tokens, "temperature": target.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    if target.ignore_eos:
        body["ignore_eos"] = True
    body.update(target.extra_body)
    return body


async def send(http: aiohttp.ClientSession, target: Target, spec: RequestSpec, index: int,
               run_start: float, on_tokens: Callable[[int], None] | None = None) -> RequestRecord:
    """POST the spec, read the SSE stream to its end, and time it; never raises for server faults.

    on_tokens(n), when given, hears of tokens as they arrive: 1 for each content chunk, then, at the end of
    a successful request, the usage count's difference from the chunk count, so that the calls sum to its
    num_output_tokens (a failed request's chunks stay counted: they were received).
    """
    record = RequestRecord(index, max_tokens=spec.max_tokens, num_prompt_tokens=spec.num_prompt_tokens)
    started = time.perf_counter()
    record.start_s = started - run_start
    stream = StreamTimer(started, on_tokens)
    await _exchange(http, target, spec, record, stream)
    if on_tokens is not None and record.is_ok:
        on_tokens(record.num_output_tokens - len(stream.content_times))
    return record


async def _exchange(http: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord,
                    stream: StreamTimer) -> None:
    try:
        timeout = aiohttp.ClientTimeout(total=target.timeout_s)
        async with http.post(target.url, json=request_body(target, spec), headers=target.headers,
                             timeout=timeout) as resp:
            if resp.status != 200:
                record.error_kind = f"http_{resp.status}"
                record.error_message = _error_message(await resp.text())
                return
            async for chunk in resp.content.iter_any():
                stream.feed(chunk, time.perf_counter())
                if stream.is_finished:
                    break
            stream.close(time.perf_counter())
    except asyncio.TimeoutError:
        record.error_kind, record.error_message = "timeout", f"no complete answer within {target.timeout_s}s"
        return
    except aiohttp.ClientError as exc:
        record.error_kind, record.error_message = "connection", f"{type(exc).__name__}: {exc}"
        return
    stream.fill(record)


class StreamTimer:
    """Folds the SSE events of one response into timings and counts; times are perf_counter seconds.

    TTFT: the first chunk with non-empty text (content). ITL: the gaps between successive non-empty
    chunks. E2E: the [DONE] event (or the stream's end). Output tokens: usage.completion_tokens when the
    server reports it, else the number of non-empty chunks.
    """

    def __init__(self, started: float, on_tokens: Callable[[int], None] | None = None) -> None:
        self.started = started
        self.on_tokens = on_tokens
        self.parser = SseParser()
        self.content_times: list[float] = []
        self.first_choice_time: float | None = None
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done_time: float | None = None
        self.end_time: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.done_time is not None or self.error is not None

    def feed(self, chunk: bytes, now: float) -> None:
        for payload in self.parser.feed(chunk):
            self._event(payload, now)

    def close(self, now: float) -> None:
        for payload in self.parser.close():
            self._event(payload, now)
        self.end_time = now

    def _event(self, payload: str, now: float) -> None:
        if self.is_finished:
            return
        event = interpret(payload)
        if event.usage:
            self.usage = event.usage
        if event.kind is EventKind.DONE:
            self.done_time = now
        elif event.kind is EventKind.ERROR:
            self.error = event.error
        elif event.kind is EventKind.CONTENT:
            if self.first_choice_time is None:
                self.first_choice_time = now
            if event.text:
                self.content_times.append(now)
                self.text.append(event.text)
                if self.on_tokens is not None:
                    self.on_tokens(1)
            self.finish_reason = event.finish_reason or self.finish_reason

    def fill(self, record: RequestRecord) -> None:
        if self.error is not None:
            record.error_kind, record.error_message = "stream_error", self.error
        elif self.done_time is None and self.finish_reason is None:
            record.error_kind, record.error_message = "incomplete_stream", "the stream ended without [DONE]"
        first = self.content_times[0] if self.content_times else self.first_choice_time
        record.ttft_s = first - self.started if first is not None else None
        record.itl_s = [b - a for a, b in zip(self.content_times, self.content_times[1:])]
        end = self.done_time if self.done_time is not None else self.end_time
        record.e2e_s = end - self.started if end is not None else None
        record.output_text = "".join(self.text)
        record.finish_reason = self.finish_reason
        record.num_output_tokens = len(self.content_times)
        if self.usage:
            prompt, completion, cached = usage_counts(self.usage)
            record.num_prompt_tokens = prompt if prompt is not None else record.num_prompt_tokens
            record.num_output_tokens = completion if completion is not None else record.num_output_tokens
            record.num_cached_tokens = cached


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
        return (error.get("message") if isinstance(error, dict) else str(error))[:300]
    except (ValueError, AttributeError, TypeError):
        return text[:300]
