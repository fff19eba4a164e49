"""Structured logging: JSON lines in containers (or when RADIXSERVE_LOG_JSON=1), readable on a terminal."""
from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("RADIXSERVE_LOG_LEVEL", "info")).upper()
    is_json = os.environ.get("RADIXSERVE_LOG_JSON", "1" if not sys.stderr.isatty() else "0") == "1"
    renderer = structlog.processors.JSONRenderer() if is_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), structlog.processors.format_exc_info,
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        # NOTE: one write() per line: `print` writes the text and its newline apart, and with an unbuffered stderr
        # (PYTHONUNBUFFERED) two services sharing one log could interleave inside a line
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True)
    structlog.contextvars.bind_contextvars(service=service)


def write_line(text: str) -> None:
    """A plain line on stderr (serve's own lines, a worker's load progress), text and newline in one write: print
    writes them apart, and with an unbuffered stderr (PYTHONUNBUFFERED) another process's line could land between."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
