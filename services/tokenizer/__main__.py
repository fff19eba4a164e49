"""`python -m services.tokenizer`: load the tokenizer and run the tokenizer service until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import dataclasses

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.model_files import load_tokenizer, model_context_length, model_id_for
from services.tokenizer.service import TokenizerService
from shared.config import load_config
from shared.hashing import self_check
from shared.logging import configure_logging


def main() -> None:
    config = load_config(TokenizerConfig)
    configure_logging("tokenizer", config.log_level)
    self_check()
    tokenizer = load_tokenizer(config.model)
    # NOTE: as the worker takes it: the smaller of --max-model-len and the model's own, either when the other is unknown
    limits = [n for n in (config.max_model_len, model_context_length(config.model)) if n]
    config = dataclasses.replace(config, max_model_len=min(limits, default=0))
    service = TokenizerService(config, tokenizer, model_id_for(config.model))
    asyncio.run(service.run())


if __name__ == "__main__":
    main()
