"""Server-sent events: bytes → event data payloads, and one OpenAI stream payload → a StreamEvent (pure)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any


class SseParser:
    """Incremental SSE framing: feed raw bytes in any split, get each complete event's data.

    An event ends at a blank line; its `data:` lines join with "\\n"; `event:`, `id:`, `retry:` and
    `:` comment lines are ignored; CRLF, CR and LF line ends are all accepted. A stream that ends
    without the final blank line still yields its last event from close().
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._decoder_tail = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        text = self._decode(chunk)
        self._buffer += text
        events: list[str] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            line, self._buffer = self._buffer[:cut[0]], self._buffer[cut[1]:]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def close(self) -> list[str]:
        """Flush: a last line without its newline, and an event without its blank line."""
        events = self.feed(b"")
        if self._buffer:
            event = self._line(self._buffer)
            self._buffer = ""
            if event is not None:
                events.append(event)
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _decode(self, chunk: bytes) -> str:
        """UTF-8 across chunk boundaries: a split multi-byte character waits for its rest."""
        data = self._decoder_tail + chunk
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._decoder_tail = data[cut:]
            return text
        self._decoder_tail = b""
        return data.decode("utf-8", errors="replace")

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def _line_end(buffer: str) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None. NOTE: a trailing CR may be half a CRLF, so it waits."""
    for i, ch in enumerate(buffer):
        if ch == "\n":
            return i, i + 1
        if ch == "\r":
            if i + 1 == len(buffer):
                return None
            return (i, i + 2) if buffer[i + 1] == "\n" else (i, i + 1)
    return None


class EventKind(Enum):
    CONTENT = "content"  # a choice with text (possibly empty) or a finish reason
    USAGE = "usage"  # the include_usage chunk (no choices)
    ERROR = "error"  # data: {"error": ...}
    DONE = "done"  # data: [DONE]
    OTHER = "other"  # a chunk with nothing for us (e.g. usage: null, no choices)


@dataclass
class StreamEvent:
    kind: EventKind
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str = ""


def interpret(payload: str) -> StreamEvent:
    """One event's data from /v1/completions or /v1/chat/completions streams."""
    if payload.strip() == "[DONE]":
        return StreamEvent(EventKind.DONE)
    try:
        body = json.loads(payload)
    except json.JSONDecodeError:
        return StreamEvent(EventKind.ERROR, error=f"not JSON: {payload[:200]!r}")
    if not isinstance(body, dict):
        return StreamEvent(EventKind.ERROR, error=f"not a JSON object: {payload[:200]!r}")
    if body.get("error") is not None:
        error = body["error"]
        message = error.get("message", "") if isinstance(error, dict) else str(error)
        return StreamEvent(EventKind.ERROR, error=message or json.dumps(error)[:200])
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    choices = body.get("choices") or []
    if not choices:
        return StreamEvent(EventKind.USAGE, usage=usage) if usage else StreamEvent(EventKind.OTHER)
    choice = choices[0] if isinstance(choices[0], dict) else {}
    delta = choice.get("delta")
    text = (delta or {}).get("content") if isinstance(delta, dict) else choice.get("text")
    return StreamEvent(EventKind.CONTENT, text=text or "", finish_reason=choice.get("finish_reason"), usage=usage)


def usage_counts(usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) of an OpenAI usage object; None where absent."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached
