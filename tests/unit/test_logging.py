"""The services' log lines and serve's own: each leaves in one write, so processes sharing one stderr never
interleave inside a line."""
from __future__ import annotations

import json
import sys
import threading

import pytest
import structlog

from radixserve import serve
from shared.logging import configure_logging


class RecordingStream:
    """An unbuffered stream (as with PYTHONUNBUFFERED=1): each write() would be its own syscall."""

    def __init__(self, tty: bool = False) -> None:
        self.writes: list[str] = []
        self.tty = tty

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def restore_structlog():
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


@pytest.mark.parametrize("json_lines", ["1", "0"])
def test_each_log_line_is_one_write_ending_in_its_newline(json_lines: str, monkeypatch: pytest.MonkeyPatch,
                                                          restore_structlog: None) -> None:
    stream = RecordingStream()
    monkeypatch.setattr(sys, "stderr", stream)  # NOTE: in the body: pytest's capture resets sys.stderr after setup
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


class RestartingSuite:
    """serve's Suite as wait_ready sees it: one restart to report, no child failing, no server answering."""

    def __init__(self) -> None:
        self.supervised: list = []
        self.lines = ["worker0 restarted (pid 4242)"]

    def supervise(self, env: dict[str, str], now: float) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


@pytest.mark.parametrize("tty", [False, True])
def test_serves_start_up_lines_are_whole_off_a_terminal(tty: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off a terminal (a log file, a container) every line serve writes while its children start is one write with
    its newline: a progress line left open would run into the next child's log line. On a terminal the progress
    still rewrites one line."""
    stream = RecordingStream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    assert not serve.wait_ready(RestartingSuite(), "http://127.0.0.1:1", 1.5, threading.Event(), {})
    text = "".join(stream.writes)
    assert "radixserve: worker0 restarted (pid 4242)\n" in text
    assert "radixserve: loading the model ..." in text
    assert text.endswith("radixserve: no worker became ready within 2s\n")
    if tty:
        assert "\rradixserve: loading the model ..." in text
    else:
        assert "\r" not in text
        assert all(w.endswith("\n") and w.count("\n") == 1 for w in stream.writes), stream.writes
