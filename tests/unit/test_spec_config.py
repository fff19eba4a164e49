"""Speculative decoding's settings: EngineConfig checks, WorkerConfig → EngineConfig, `serve` flags passed to the
workers, and the request's `speculative` body field through the gateway."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from radixserve import serve
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine_config import EngineConfig
from shared.config import load_config
from tests.unit.test_gateway_protocol import chat, completion, error_of


def test_worker_config_gives_the_engine_its_speculative_settings() -> None:
    config = WorkerConfig(speculative_method="ngram", num_speculative_tokens=3).engine_config()
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    assert WorkerConfig().engine_config().speculative_method is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"speculative_method": "eagle"}, "speculative_method must be one of ngram"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "tensor_parallel_size": 2}, "single-rank"),
])
def test_engine_config_refuses_bad_speculative_settings(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_serve_passes_the_speculative_flags_to_workers(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    args = parser.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "6",
                              "--redis-url", "redis://x:1"])
    children = {c.name: c.argv for c in serve.build_suite(args, tmp_path).children}
    worker = load_config(WorkerConfig, children["worker0"][1:])
    assert (worker.speculative_method, worker.num_speculative_tokens) == ("ngram", 6)
    assert worker.engine_config().speculative_method == "ngram"


def test_a_request_turns_speculation_off_with_a_body_field() -> None:
    assert chat().generate.sampling.speculative is True
    assert chat(speculative=False).generate.sampling.speculative is False
    assert completion(speculative=False).generates[0].sampling.speculative is False
    assert error_of(chat, speculative="no").param == "speculative"
