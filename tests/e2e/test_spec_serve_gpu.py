"""Speculative decoding served on the GPU (issue 26): `radixserve serve --device cuda` on the bundled SmolLM2-135M
(bf16, the verify step under CUDA graphs), with `--speculative-method ngram` and with `--speculative-method draft`,
gives the same greedy answers over HTTP as the same server without speculation: whole and streamed, token by token,
on the edit-a-passage workload where prompt lookup drafts and the target accepts. Skipped without a CUDA device (CI
has none); run on the GPU with `python -m pytest -m gpu tests/e2e/test_spec_serve_gpu.py` (bench/device_plan.sh t).

Same up to bf16: a verify row scores its tokens in a multi-token forward, a plain decode in a one-token one, and in
bf16 the two round differently: logits come out of the LM head in bf16, whose step is 0.125 between 16 and 32, so the
two paths can differ by a step or two. Where the top two tokens are that close, the two servers may pick
differently, and their answers part there. So each pair of answers must be equal token by token, or part only
at a near-tie: both tokens among the other side's top five, within NEAR_TIE nats of each other on both sides. A
wrong verification (a rejected draft kept, an accepted one dropped, a token off by one position) parts the answers
at a token the model does not rank next to its own choice, and fails. The float32 CPU tests (test_spec_serve.py)
demand equality outright."""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch

from tests.e2e.conftest import serving
from tests.e2e.test_spec_serve import MODEL, PASSAGES, _client, _messages, _metric, _wait_for_accepted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_ARGS = ["--device", "cuda", "--num-pages", "1024"]  # a small pool: three servers share one GPU
NEAR_TIE = 0.5  # nats: a few bf16 steps of a logit (module docstring)
TOP = 5


class Step(NamedTuple):
    token: str
    top: dict[str, float]  # the TOP most likely tokens at this position and their logprobs


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


def _steps(entries) -> list[Step]:
    return [Step(e.token, {t.token: t.logprob for t in e.top_logprobs}) for e in entries]


def _greedy(url: str, messages: list[dict], max_tokens: int, stream: bool) -> tuple[list[Step], str]:
    """A greedy chat answer's tokens with their top logprobs, and its finish reason."""
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, logprobs=True,
                  top_logprobs=TOP)
    if not stream:
        choice = _client(url).chat.completions.create(**kwargs).choices[0]
        return _steps(choice.logprobs.content), choice.finish_reason
    steps, finish = [], None
    for chunk in _client(url).chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                steps += _steps(choice.logprobs.content)
            finish = choice.finish_reason or finish
    return steps, finish


def greedy_parting(a: list[Step], b: list[Step], near_tie: float = NEAR_TIE) -> int | None:
    """Where two greedy answers part (None: they do not), asserting that they part only at a near-tie (module
    docstring); an answer that stops while the other goes on parts them too, and must be at a near-tie as well."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x.token == y.token:
            continue
        assert y.token in x.top and x.token in y.top, f"token {i}: {x.token!r} vs {y.token!r}, not in each other's top"
        gaps = (x.top[x.token] - x.top[y.token], y.top[y.token] - y.top[x.token])
        assert max(gaps) <= near_tie, f"token {i}: {x.token!r} vs {y.token!r} apart by {gaps} nats, not a near-tie"
        return i
    assert len(a) == len(b), f"one answer ended after {min(len(a), len(b))} tokens, the other went on"
    return None


def test_greedy_parting_accepts_equal_answers_and_near_ties_only() -> None:
    """The comparison itself (runs on the CPU too): equal, parted at a near-tie, parted where the model had no
    doubt, cut short."""
    same = [Step("a", {"a": -0.1, "b": -2.5}), Step("b", {"b": -0.5, "c": -0.55})]
    assert greedy_parting(same, same) is None
    tie = [same[0], Step("c", {"c": -0.5, "b": -0.8})]
    assert greedy_parting(same, tie) == 1
    with pytest.raises(AssertionError, match="not a near-tie"):
        greedy_parting(same, [same[0], Step("c", {"c": -0.3, "b": -1.9})])
    with pytest.raises(AssertionError, match="top"):
        greedy_parting(same, [same[0], Step("d", {"d": -0.01})])
    with pytest.raises(AssertionError, match="went on"):
        greedy_parting(same, same[:1])


@pytest.mark.gpu
@needs_cuda
def test_greedy_answers_on_the_gpu_equal_a_server_without_speculation(plain_gpu: str, spec_gpu: str) -> None:
    before = _metric(spec_gpu, "radixserve_spec_decode_num_accepted_tokens_total")
    partings = []
    for code, ask in PASSAGES:
        messages = _messages(code, ask)
        spec, spec_finish = _greedy(spec_gpu, messages, 48, False)
        plain, plain_finish = _greedy(plain_gpu, messages, 48, False)
        partings.append(greedy_parting(spec, plain))
        if partings[-1] is None:
            assert len(spec) == 48 and spec_finish == plain_finish
    code, ask = PASSAGES[1]
    streamed = [_greedy(url, _messages(code, ask), 64, True)[0] for url in (spec_gpu, plain_gpu)]
    partings.append(greedy_parting(*streamed))
    print("token where each pair of answers parted (None: equal):", partings)
    assert partings.count(None) >= len(partings) - 1  # near-ties are rare: at most one pair parts
    assert _wait_for_accepted(spec_gpu, before)  # drafts were accepted: the verify path ran
