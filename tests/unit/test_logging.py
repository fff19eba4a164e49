"""The services' log lines: each leaves in one write, so processes sharing one stderr never interleave inside a line."""
from __future__ import annotations

import json
import sys

import pytest
import structlog

from shared.logging import configure_logging


class RecordingStream:
    """An unbuffered stream (as with PYTHONUNBUFFERED=1): each write() would be its own syscall."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.fixture
def restore_structlog():
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


@pytest.mark.parametrize("json_lines", ["1", "0"])
def test_each_log_line_is_one_write_ending_in_its_newline(json_lines: str, monkeypatch: pytest.MonkeyPatch,
                                                          restore_structlog: None) -> None:
    stream = RecordingStream()
    monkeypatch.setattr(sys, "stderr", stream)  # NOTE: in the test's body: pytest's capture resets sys.stderr after setup
    monkeypatch.setenv("RADIXSERVE_LOG_JSON", json_lines)
    configure_logging("cache_index")
    log = structlog.get_logger()
    for i in range(3):
        log.info("stopped", max_loop_stall_ms=14 + i)
    assert len(stream.writes) == 3, stream.writes
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in stream.writes), stream.writes
    assert all("service" in w and "cache_index" in w for w in stream.writes)
    if json_lines == "1":
        assert [json.loads(w)["max_loop_stall_ms"] for w in stream.writes] == [14, 15, 16]
