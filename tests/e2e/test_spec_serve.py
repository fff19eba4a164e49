"""`radixserve serve --speculative-method ngram` over HTTP on the bundled SmolLM2-135M: greedy answers (whole and
streamed, with logprobs, with a stop string) identical to a server without speculation, on an edit-a-passage
workload where prompt lookup drafts and the target accepts; the spec_decode series on /metrics count them. The same
for `--speculative-method draft --speculative-draft-model bundled` (the target as its own draft)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from bench.spec_decode import PASSAGES, SYSTEM
from tests.e2e.conftest import scraped_sum as _metric, serving

MODEL = "smollm2-135m-instruct"


def _messages(code: str, ask: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"```python\n{code}```\n\n{ask}"}]


@pytest.fixture(scope="module")
def spec_served(tmp_path_factory) -> Iterator[str]:
    args = ["--device", "cpu", "--num-pages", "512", "--speculative-method", "ngram", "--num-speculative-tokens", "4"]
    with serving(args, tmp_path_factory.mktemp("spec") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def draft_served(tmp_path_factory) -> Iterator[str]:
    args = ["--device", "cpu", "--num-pages", "512", "--speculative-method", "draft", "--speculative-draft-model",
            "bundled", "--num-speculative-tokens", "4"]
    with serving(args, tmp_path_factory.mktemp("draft") / "serve.log") as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _answers(url: str, **kwargs) -> list[tuple[str, str, int]]:
    client = _client(url)
    out = []
    for code, ask in PASSAGES:
        reply = client.chat.completions.create(model=MODEL, messages=_messages(code, ask), temperature=0,
                                               max_tokens=48, **kwargs)
        choice = reply.choices[0]
        logprobs = None if choice.logprobs is None else [round(t.logprob, 3) for t in choice.logprobs.content]
        out.append((choice.message.content, choice.finish_reason, reply.usage.completion_tokens, logprobs))
    return out


def test_greedy_answers_equal_a_server_without_speculation(served: str, spec_served: str) -> None:
    before = _metric(spec_served, "radixserve_spec_decode_num_accepted_tokens_total")
    with_spec = _answers(spec_served, logprobs=True)
    assert with_spec == _answers(served, logprobs=True)
    assert all(tokens == 48 for _, _, tokens, _ in with_spec)
    assert _wait_for_accepted(spec_served, before)


def _wait_for_accepted(url: str, before: float) -> bool:
    """NOTE: engine series come with heartbeats (every 0.5 s)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if _metric(url, "radixserve_spec_decode_num_accepted_tokens_total") > before:
            return True
        time.sleep(0.5)
    return False


def _streamed(url: str, **kwargs) -> str:
    stream = _client(url).chat.completions.create(**kwargs, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_streamed_and_stopped_answers_equal_a_server_without_speculation(served: str, spec_served: str) -> None:
    code, ask = PASSAGES[1]
    kwargs = dict(model=MODEL, messages=_messages(code, ask), temperature=0, max_tokens=64)
    texts = [_streamed(url, **kwargs) for url in (spec_served, served)]
    assert texts[0] == texts[1]
    stop = "return []"  # inside the copied code, past its first lines
    stopped = [_client(url).chat.completions.create(**kwargs, stop=[stop]).choices[0] for url in (spec_served, served)]
    assert stopped[0].message.content == stopped[1].message.content
    assert stopped[0].finish_reason == "stop" and stop not in stopped[0].message.content


def test_a_request_may_turn_speculation_off(spec_served: str, served: str) -> None:
    code, ask = PASSAGES[2]
    kwargs = dict(model=MODEL, messages=_messages(code, ask), temperature=0, max_tokens=24)
    before = _metric(spec_served, "radixserve_spec_decode_num_drafts_total")
    off = _client(spec_served).chat.completions.create(**kwargs, extra_body={"speculative": False})
    plain = _client(served).chat.completions.create(**kwargs)
    assert off.choices[0].message.content == plain.choices[0].message.content
    time.sleep(1.2)  # two heartbeats
    assert _metric(spec_served, "radixserve_spec_decode_num_drafts_total") == before


def test_draft_model_greedy_answers_equal_a_server_without_speculation(served: str, draft_served: str) -> None:
    before = {name: _metric(draft_served, f"radixserve_spec_decode_{name}_total")
              for name in ("num_draft_tokens", "num_accepted_tokens")}
    code, ask = PASSAGES[0]
    kwargs = dict(model=MODEL, messages=_messages(code, ask), temperature=0, max_tokens=48)
    texts = [_streamed(url, **kwargs) for url in (draft_served, served)]
    assert texts[0] == texts[1]
    replies = [_client(url).chat.completions.create(**kwargs, logprobs=True).choices[0]
               for url in (draft_served, served)]
    assert replies[0].message.content == replies[1].message.content == texts[0]
    assert [t.token for t in replies[0].logprobs.content] == [t.token for t in replies[1].logprobs.content]
    assert _wait_for_accepted(draft_served, before["num_accepted_tokens"])
    drafted = _metric(draft_served, "radixserve_spec_decode_num_draft_tokens_total") - before["num_draft_tokens"]
    accepted = _metric(draft_served, "radixserve_spec_decode_num_accepted_tokens_total") - before["num_accepted_tokens"]
    assert accepted >= 0.9 * drafted > 0  # the draft is the target: only float near-ties may differ
