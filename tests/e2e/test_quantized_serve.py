"""`radixserve serve` with quantized weights, over HTTP, on the bundled SmolLM2-135M: FP8 quantized on load
(`--quantization fp8`), INT4 quantized on load (`--quantization awq`), and checkpoints our own quantizer wrote in
the AutoAWQ and GPTQ layouts (served as published). Each answers a factual prompt correctly, greedy."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from services.gpu_worker.model.loader import bundled_cache_dir, load_bundled
from tests.e2e.conftest import serving
from tests.unit.quant_checkpoints import write_quantized

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def bundled_dir() -> Path:
    load_bundled()  # writes the bundled model's Hugging Face directory once
    return bundled_cache_dir()


def _served_args(tmp_path: Path, bundled_dir: Path, case: str) -> list[str]:
    if case in ("fp8-on-load", "awq-on-load"):
        return ["--quantization", case.removesuffix("-on-load")]
    method = case.removesuffix("-checkpoint")
    path, _ = write_quantized(bundled_dir, tmp_path / method, method, group_size=64)  # K = 576: groups of 64
    return ["--model", str(path)]


@pytest.mark.parametrize("case", ["fp8-on-load", "awq-on-load", "awq-checkpoint", "gptq-checkpoint"])
def test_quantized_model_answers_over_http(tmp_path: Path, bundled_dir: Path, case: str):
    args = [*_served_args(tmp_path, bundled_dir, case), "--device", "cpu", "--num-pages", "256"]
    with serving(args, tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        completion = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                               max_tokens=8, temperature=0)
        assert completion.choices[0].text.strip().startswith("Paris"), completion.choices[0].text
        assert completion.usage.completion_tokens == 8 or completion.choices[0].finish_reason == "stop"
    log = (tmp_path / "serve.log").read_text()
    assert "linear layers quantized" in log  # the worker says what it loaded
