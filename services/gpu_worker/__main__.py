"""`python -m services.gpu_worker`: build the config, load the model, serve until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import sys

import structlog

from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.service import WorkerService
from shared.config import load_config
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(WorkerConfig, argv)
    except ValueError as exc:
        print(f"gpu_worker: {exc}", file=sys.stderr)
        return 2
    configure_logging("gpu_worker", config.log_level)
    try:
        asyncio.run(WorkerService(config).run())
    except Exception as exc:  # noqa: BLE001 - a start-up failure (bad model, address in use) ends the process
        structlog.get_logger(__name__).exception("gpu_worker failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
