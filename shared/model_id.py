"""The model id a model spec serves under: the salt of every block hash, derived here once for all services."""
from __future__ import annotations

import re
from pathlib import Path

BUNDLED_MODEL_ID = "smollm2-135m-instruct"
BUNDLED_SPECS = ("bundled", BUNDLED_MODEL_ID)
RANDOM_PREFIX = "random:"


def model_id_for(spec: str | Path) -> str:
    """"bundled" → its id; "random:<preset>" → itself; an HF directory → "org/name" from a hub cache path, else
    the directory's name.

    NOTE: the tokenizer salts prompt hashes and the gpu_worker salts its cached blocks with this id: both must
    call this function, or prompts never match the workers' cached blocks.
    """
    spec = str(spec)
    if spec in BUNDLED_SPECS:
        return BUNDLED_MODEL_ID
    if spec.startswith(RANDOM_PREFIX):
        return spec
    path = Path(spec).expanduser().resolve()
    match = re.search(r"models--([^/]+)--([^/]+)/snapshots/", str(path))
    return f"{match[1]}/{match[2]}" if match else path.name
