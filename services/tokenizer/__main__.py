"""`python -m services.tokenizer`: load the tokenizer and run the tokenizer service until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.model_files import load_tokenizer, model_id_for
from services.tokenizer.service import TokenizerService
from shared.config import load_config
from shared.hashing import self_check
from shared.logging import configure_logging


def main() -> None:
    config = load_config(TokenizerConfig)
    configure_logging("tokenizer", config.log_level)
    self_check()
    service = TokenizerService(config, load_tokenizer(config.model), model_id_for(config.model))
    asyncio.run(service.run())


if __name__ == "__main__":
    main()
