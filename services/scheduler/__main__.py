"""`python -m services.scheduler`: build the config and run the scheduler actor until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio

from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.config import load_config
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    config = load_config(SchedulerConfig, argv)
    configure_logging("scheduler", config.log_level)
    asyncio.run(SchedulerService(config).run())


if __name__ == "__main__":
    main()
