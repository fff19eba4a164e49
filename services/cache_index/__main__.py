"""`python -m services.cache_index`: build the config and run the cache_index actor until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio

from services.cache_index.config import CacheIndexConfig
from services.cache_index.service import CacheIndexService
from shared.config import load_config
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    config = load_config(CacheIndexConfig, argv)
    configure_logging("cache_index", config.log_level)
    asyncio.run(CacheIndexService(config).run())


if __name__ == "__main__":
    main()
