"""`python -m services.gateway`: run the OpenAI-compatible HTTP gateway until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio

from services.gateway.config import GatewayConfig
from services.gateway.service import Gateway
from shared.config import load_config
from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> None:
    config = load_config(GatewayConfig, argv)
    configure_logging("gateway", config.log_level)
    asyncio.run(Gateway(config).run())


if __name__ == "__main__":
    main()
