"""Pins the system-wide block hash: golden values, chaining, salt, partial pages, process independence."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from shared import hashing
from shared.hashing import GOLDEN, hash_blocks, self_check

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(100, 123))


def test_golden_values_are_pinned() -> None:
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "model-a") == [
        562120753373719963, 13978932826403659240]
    assert hash_blocks([0, 0, 0, 0], 4, "") == [3056837209887595860]
    assert hash_blocks([4294967295, 7, 8, 9, 10, 11], 2, "Qwen/Qwen3-0.6B") == [
        14331453445014659165, 10761852588369064278, 15651161617206231367]
    assert hash_blocks([1, 2, 3, 4], 4, "model-a", parent_hash=12345) == [15091792626459371960]


def test_definition_matches_spec() -> None:
    def h(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    root = h(b"model-a")
    first = h(root.to_bytes(8, "little") + struct.pack("<4I", 1, 2, 3, 4))
    second = h(first.to_bytes(8, "little") + struct.pack("<4I", 5, 6, 7, 8))
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, "model-a") == [first, second]


def test_self_check_passes_and_detects_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    self_check()
    assert len(GOLDEN) >= 3
    token_ids, page_size, salt, parent_hash, expected = GOLDEN[0]
    bad = ((token_ids, page_size, salt, parent_hash, (expected[0] ^ 1,) + expected[1:]),)
    monkeypatch.setattr(hashing, "GOLDEN", bad)
    with pytest.raises(RuntimeError):
        hashing.self_check()


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_prefix_pages_hash_to_prefix_of_hashes(page_size: int) -> None:
    full = hash_blocks(TOKENS, page_size, "m")
    for num_pages in range(len(full) + 1):
        assert hash_blocks(TOKENS[:num_pages * page_size], page_size, "m") == full[:num_pages]


@pytest.mark.parametrize("split_page", [1, 2, 5])
def test_parent_hash_continuation_equals_one_shot(split_page: int) -> None:
    full = hash_blocks(TOKENS, 4, "m")
    head = hash_blocks(TOKENS[:split_page * 4], 4, "m")
    tail = hash_blocks(TOKENS[split_page * 4:], 4, "m", parent_hash=head[-1])
    assert head + tail == full


def test_salt_changes_every_hash() -> None:
    a = hash_blocks(TOKENS, 4, "model-a")
    b = hash_blocks(TOKENS, 4, "model-b")
    assert not set(a) & set(b)


def test_partial_page_is_ignored() -> None:
    assert hash_blocks(TOKENS[:11], 4, "m") == hash_blocks(TOKENS[:8], 4, "m")
    assert len(hash_blocks(TOKENS[:11], 4, "m")) == 2
    assert hash_blocks([1, 2, 3], 4, "m") == []
    assert hash_blocks([], 4, "m") == []


def test_hashes_are_unsigned_64_bit() -> None:
    assert all(0 <= h < 2**64 for h in hash_blocks(TOKENS, 1, "m"))


def test_rejects_bad_page_size() -> None:
    with pytest.raises(ValueError):
        hash_blocks(TOKENS, 0, "m")


def test_same_values_in_subprocess_with_other_hash_seed() -> None:
    code = ("import json; from shared.hashing import hash_blocks; "
            "print(json.dumps(hash_blocks(list(range(100, 123)), 4, 'm')))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == hash_blocks(TOKENS, 4, "m")
