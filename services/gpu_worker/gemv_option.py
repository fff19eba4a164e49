"""gemv_max_tokens, the option that puts steps of few tokens on the Triton GEMV (kernels/gemv.py): its range and its
flag's parsing. No torch here, so `radixserve serve` can check the flag before it starts anything."""
from __future__ import annotations

GEMV_MAX_TOKENS_LIMIT = 16  # kernels/gemv.MAX_TOKENS (a test pins the two)


def check_gemv_max_tokens(value: int) -> int:
    if not 0 <= value <= GEMV_MAX_TOKENS_LIMIT:
        raise ValueError(f"gemv_max_tokens must be 0 to {GEMV_MAX_TOKENS_LIMIT}, not {value}")
    return value


def parse_gemv_max_tokens(text: str) -> int | None:
    """A --gemv-max-tokens flag's value: "auto" → None (EngineConfig's default), else an int from 0 to the limit."""
    if text.strip().lower() == "auto":
        return None
    try:
        return check_gemv_max_tokens(int(text))
    except ValueError:
        raise ValueError(f"gemv_max_tokens must be auto or 0 to {GEMV_MAX_TOKENS_LIMIT}, not {text!r}") from None
