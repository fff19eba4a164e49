"""`radixserve serve --tensor-parallel-size 2` on the CPU: the worker's model is sharded over two gloo ranks,
and its greedy tokens equal the offline engine's on one rank (same random weights, same prompt)."""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.request import SamplingParams
from tests.e2e.conftest import serving

pytestmark = pytest.mark.slow
MODEL = "random:tiny-llama"  # 4 query / 2 KV heads: divisible by 2
PROMPT_IDS = [7, 99, 23, 305, 11, 42, 8, 260, 71, 5] * 3


def test_serve_with_two_tensor_parallel_ranks_equals_one_rank(tmp_path) -> None:
    offline = Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32", num_pages=256))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = offline.generate([PROMPT_IDS], params)[0].samples[0].token_ids

    with serving(["--model", MODEL, "--device", "cpu", "--dtype", "float32", "--num-pages", "256",
                  "--tensor-parallel-size", "2"], tmp_path / "serve.log", ready_timeout_s=180) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
        tokens = reply.choices[0].logprobs.tokens
    assert tokens == [f"token_id:{t}" for t in expected]


def test_serve_refuses_tensor_parallel_with_pd() -> None:
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--pd", "1:1", "--tensor-parallel-size", "2",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tensor-parallel-size > 1 works with mixed workers only" in proc.stderr
