"""Speculative decoding served on the GPU (issue 26): `radixserve serve --device cuda` on the bundled SmolLM2-135M
(bf16, the verify step under CUDA graphs), with `--speculative-method ngram` and with `--speculative-method draft`,
gives the same greedy answers over HTTP as the same server without speculation: whole, streamed, and token by token
in the logprobs, on the edit-a-passage workload where prompt lookup drafts and the target accepts. Skipped without
a CUDA device (CI has none); run on the GPU with `python -m pytest -m gpu tests/e2e/test_spec_serve_gpu.py`."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.e2e.conftest import serving
from tests.e2e.test_spec_serve import MODEL, PASSAGES, _client, _messages, _metric, _streamed, _wait_for_accepted

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_ARGS = ["--device", "cuda", "--num-pages", "1024"]  # a small pool: three servers share one GPU


@pytest.fixture(scope="module")
def plain_gpu(tmp_path_factory) -> Iterator[str]:
    with serving(GPU_ARGS, tmp_path_factory.mktemp("plain_gpu") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module", params=["ngram", "draft"])
def spec_gpu(request, tmp_path_factory) -> Iterator[str]:
    args = [*GPU_ARGS, "--speculative-method", request.param, "--num-speculative-tokens", "4"]
    if request.param == "draft":
        args += ["--speculative-draft-model", "bundled"]
    with serving(args, tmp_path_factory.mktemp(f"{request.param}_gpu") / "serve.log") as url:
        yield url


def _tokens(url: str) -> list[tuple[str, str, int, list[str]]]:
    """Each passage's greedy answer: its text, finish reason, token count and tokens (logprob values are the
    target's, computed on a verify row where drafts were checked: equal to a decode step's up to bf16 rounding)."""
    out = []
    for code, ask in PASSAGES:
        choice = _client(url).chat.completions.create(model=MODEL, messages=_messages(code, ask), temperature=0,
                                                      max_tokens=48, logprobs=True)
        out.append((choice.choices[0].message.content, choice.choices[0].finish_reason, choice.usage.completion_tokens,
                    [t.token for t in choice.choices[0].logprobs.content]))
    return out


def test_greedy_answers_on_the_gpu_equal_a_server_without_speculation(plain_gpu: str, spec_gpu: str) -> None:
    before = _metric(spec_gpu, "radixserve_spec_decode_num_accepted_tokens_total")
    with_spec = _tokens(spec_gpu)
    assert with_spec == _tokens(plain_gpu)
    assert all(num == 48 for _, _, num, _ in with_spec)
    code, ask = PASSAGES[1]
    kwargs = dict(model=MODEL, messages=_messages(code, ask), temperature=0, max_tokens=64)
    assert _streamed(spec_gpu, **kwargs) == _streamed(plain_gpu, **kwargs)
    assert _wait_for_accepted(spec_gpu, before)  # drafts were accepted: the verify path ran
