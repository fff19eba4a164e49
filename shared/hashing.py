"""The block hash of the whole system: a chained blake2b over full pages of token ids."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 8


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest(), "little")


def salt_hash(salt: str) -> int:
    """The chain's root: h_{-1} = H(salt utf-8)."""
    return _digest(salt.encode("utf-8"))


def hash_page(parent_hash: int, page_token_ids: Sequence[int]) -> int:
    """One link: H(parent_hash as 8 little-endian bytes ‖ token ids as little-endian uint32)."""
    payload = parent_hash.to_bytes(DIGEST_SIZE, "little")
    payload += struct.pack(f"<{len(page_token_ids)}I", *page_token_ids)
    return _digest(payload)


def hash_blocks(token_ids: Sequence[int], page_size: int, salt: str,
                parent_hash: int | None = None) -> list[int]:
    """Chained hashes of the full pages of token_ids (a trailing partial page is not hashed)."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    prev = salt_hash(salt) if parent_hash is None else parent_hash
    hashes: list[int] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        prev = hash_page(prev, token_ids[start:start + page_size])
        hashes.append(prev)
    return hashes


GOLDEN: tuple[tuple[tuple[int, ...], int, str, int | None, tuple[int, ...]], ...] = (
    ((1, 2, 3, 4, 5, 6, 7, 8, 9), 4, "model-a", None, (562120753373719963, 13978932826403659240)),
    ((0, 0, 0, 0), 4, "", None, (3056837209887595860,)),
    ((4294967295, 7, 8, 9, 10, 11), 2, "Qwen/Qwen3-0.6B", None,
     (14331453445014659165, 10761852588369064278, 15651161617206231367)),
    ((1, 2, 3, 4), 4, "model-a", 12345, (15091792626459371960,)),
)


def self_check() -> None:
    """Recompute the GOLDEN cases; raise RuntimeError if this machine hashes differently."""
    for token_ids, page_size, salt, parent_hash, expected in GOLDEN:
        got = tuple(hash_blocks(token_ids, page_size, salt, parent_hash))
        if got != expected:
            raise RuntimeError(f"block hash self-check failed for salt={salt!r}: {got} != {expected}")
