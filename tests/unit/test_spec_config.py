"""Speculative decoding's settings: EngineConfig checks, WorkerConfig → EngineConfig, `serve` flags passed to the
workers, the draft model's vocabulary and pool, and the request's `speculative` body field through the gateway."""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from radixserve import serve
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.presets import preset
from services.gpu_worker.spec.draft import check_same_vocabulary, draft_num_pages
from shared.config import load_config
from tests.unit.test_gateway_protocol import chat, completion, error_of


def test_worker_config_gives_the_engine_its_speculative_settings() -> None:
    config = WorkerConfig(speculative_method="ngram", num_speculative_tokens=3).engine_config()
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    assert WorkerConfig().engine_config().speculative_method is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"speculative_method": "eagle"}, "speculative_method must be one of ngram, draft"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "tensor_parallel_size": 2}, "single-rank"),
    ({"speculative_method": "draft"}, "'draft' needs a draft model"),
    ({"speculative_method": "draft", "speculative_draft_model": ""}, "'draft' needs a draft model"),
    ({"speculative_draft_model": "bundled"}, "draft model is used by speculative_method 'draft' only, not None"),
    ({"speculative_method": "ngram", "speculative_draft_model": "bundled"}, "'draft' only, not 'ngram'"),
])
def test_engine_config_refuses_bad_speculative_settings(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_worker_config_refuses_a_draft_model_without_the_draft_method() -> None:
    with pytest.raises(ValueError, match="'draft' only"):
        WorkerConfig(speculative_draft_model="bundled")
    with pytest.raises(ValueError, match="needs a draft model"):
        WorkerConfig(speculative_method="draft")


def _served_worker(tmp_path: Path, flags: list[str]) -> WorkerConfig:
    """The config of the first worker `serve` with these flags starts."""
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    args = parser.parse_args([*flags, "--redis-url", "redis://x:1"])
    children = {c.name: c.argv for c in serve.build_suite(args, tmp_path).children}
    return load_config(WorkerConfig, children["worker0"][1:])


def test_serve_passes_the_speculative_flags_to_workers(tmp_path: Path) -> None:
    worker = _served_worker(tmp_path, ["--speculative-method", "ngram", "--num-speculative-tokens", "6"])
    assert (worker.speculative_method, worker.num_speculative_tokens) == ("ngram", 6)
    assert worker.engine_config().speculative_method == "ngram"


def test_serve_passes_the_draft_model_to_workers(tmp_path: Path) -> None:
    flags = ["--speculative-method", "draft", "--speculative-draft-model", "random:tiny-llama"]
    config = _served_worker(tmp_path, flags).engine_config()
    assert (config.speculative_method, config.speculative_draft_model) == ("draft", "random:tiny-llama")
    assert WorkerConfig().engine_config().speculative_draft_model is None


def test_a_request_turns_speculation_off_with_a_body_field() -> None:
    assert chat().generate.sampling.speculative is True
    assert chat(speculative=False).generate.sampling.speculative is False
    assert completion(speculative=False).generates[0].sampling.speculative is False
    assert error_of(chat, speculative="no").param == "speculative"


def test_the_draft_pool_is_the_targets_at_most_room_for_the_speculating_sequences() -> None:
    config = EngineConfig(speculative_method="draft", speculative_draft_model="bundled", page_size=16,
                          speculative_max_batch_size=4)
    assert draft_num_pages(config, 100) == 100
    assert draft_num_pages(config, 100_000) == 1 + 4 * 2048 // 16


def _tokenizer(vocab: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(get_vocab=lambda: dict(vocab))


def test_a_draft_model_with_another_vocabulary_is_refused() -> None:
    target = preset("tiny-llama").with_(model_id="random:tiny-llama")
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens, the target 'random:tiny-llama' 512"):
        check_same_vocabulary(target, preset("smollm2-135m").with_(model_id="random:smollm2-135m"))
    same_size = preset("tiny-qwen2")
    check_same_vocabulary(target, same_size)  # no tokenizers: the sizes are all there is to compare
    check_same_vocabulary(target, same_size, _tokenizer({"a": 0}), None)
    check_same_vocabulary(target, same_size, _tokenizer({"a": 0, "b": 1}), _tokenizer({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        check_same_vocabulary(target, same_size, _tokenizer({"a": 0, "b": 1}), _tokenizer({"a": 1, "b": 0}))


def test_an_engine_refuses_a_draft_model_of_another_vocabulary_at_start_up() -> None:
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        Engine(EngineConfig(model="random:tiny-llama", device="cpu", num_pages=16, speculative_method="draft",
                            speculative_draft_model="random:smollm2-135m"))
