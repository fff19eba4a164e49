"""`radixserve serve --pd 1:1` on the bundled model: greedy output equals the colocated suite's (`served`, two
mixed workers) token for token, streamed or not; n > 1 stays local; stop strings abort across the split."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import serving

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and a storm."}]
PROMPT_IDS = [504, 3575, 282, 4649, 314] * 24  # 120 tokens: 8 pages to hand off (the last partial)


@pytest.fixture(scope="module")
def pd_url(tmp_path_factory) -> Iterator[str]:
    with serving(["--pd", "1:1", "--pd-policy", "always", "--num-pages", "512", "--device", "cpu"],
                 tmp_path_factory.mktemp("pd") / "serve.log") as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_pd_completions_equal_colocated_token_for_token(pd_url: str, served: str) -> None:
    def run(url: str):
        reply = _client(url).completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=32, temperature=0,
                                                logprobs=0, extra_body={"ignore_eos": True})
        return reply.choices[0].logprobs.tokens, reply.choices[0].logprobs.token_logprobs, reply.usage

    pd_tokens, pd_logprobs, pd_usage = run(pd_url)
    co_tokens, co_logprobs, co_usage = run(served)

    assert pd_tokens == co_tokens and len(pd_tokens) == 32
    assert pd_logprobs == pytest.approx(co_logprobs, abs=1e-3)
    assert (pd_usage.prompt_tokens, pd_usage.completion_tokens) == (120, 32) == (co_usage.prompt_tokens,
                                                                                co_usage.completion_tokens)


def test_pd_chat_equals_colocated_streamed_or_not(pd_url: str, served: str) -> None:
    kwargs = dict(model=MODEL, messages=STORY, max_tokens=40, temperature=0)
    colocated = _client(served).chat.completions.create(**kwargs).choices[0].message.content
    whole = _client(pd_url).chat.completions.create(**kwargs).choices[0].message.content
    chunks = _client(pd_url).chat.completions.create(**kwargs, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole == streamed == colocated and len(whole) > 20


def test_n2_runs_on_the_decode_worker_and_stop_strings_end_split_requests(pd_url: str) -> None:
    client = _client(pd_url)
    two = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    full = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    cut = text.split()[3]
    stopped = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=40, temperature=0, stop=[cut])
    assert stopped.choices[0].message.content == text[: text.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
