"""`radixserve serve` end to end with the openai SDK: batched completion prompts, echo, /tokenize and /detokenize.

Greedy answers of a batch equal those of each prompt alone; a prompt that fails fails the call and stops the rest
(the engine goes idle at once instead of generating the long one to its end)."""
from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.conftest import post_json as _post, scraped_sum as _metric

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
FRANCE = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def test_a_batch_answers_as_each_prompt_alone(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,", "My favourite colour is"]
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0)
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [(c.index, c.text) for c in batch.choices] == [(i, a.choices[0].text) for i, a in enumerate(alone)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_batched_token_prompts_with_n_stream_as_they_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=[FRANCE, FRANCE[:3]], n=2, max_tokens=5, temperature=0)
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == whole.choices[1].text and whole.choices[0].text.startswith(" Paris")
    assert whole.usage.prompt_tokens == 5 + 3  # each prompt counted once, not once per sample
    texts = [""] * 4
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                              whole.usage.completion_tokens)


def test_a_failing_prompt_fails_the_call_and_stops_the_others(served: str, client: openai.OpenAI) -> None:
    generated = "radixserve_generation_tokens_total"
    before = _metric(served, generated)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[FRANCE, [504] * 9000], max_tokens=6000, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert info.value.code == "context_length_exceeded"
    time.sleep(2.0)  # NOTE: engine series come with heartbeats: before they catch up, an idle engine is no proof
    deadline = time.monotonic() + 15
    previous = _metric(served, generated)
    while True:
        time.sleep(1.2)
        current = _metric(served, generated)
        busy = _metric(served, "radixserve_num_requests_running") + _metric(served, "radixserve_num_requests_waiting")
        if not busy and current == previous:
            break
        assert time.monotonic() < deadline, "the batch's other prompt still runs"
        previous = current
    assert current - before < 500  # the first prompt asked for 6,000 tokens (about 12 a second here)


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                        temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert by_text.choices[0].text == "The capital of France is" + plain.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[FRANCE], max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.completion_tokens == plain.usage.completion_tokens
    with_logprobs = client.completions.create(model=MODEL, prompt=[FRANCE], max_tokens=4, temperature=0, echo=True,
                                              logprobs=1)  # the prompt's logprobs: tests/e2e/test_prompt_logprobs.py
    assert with_logprobs.choices[0].text == by_ids.choices[0].text
    assert len(with_logprobs.choices[0].logprobs.tokens) == len(FRANCE) + with_logprobs.usage.completion_tokens


def test_tokenize_and_detokenize(served: str, client: openai.OpenAI) -> None:
    status, body = _post(served + "/tokenize", {"model": MODEL, "prompt": "The capital of France is"})
    assert (status, body) == (200, {"count": 5, "max_model_len": 8192, "tokens": FRANCE, "token_strs": None})
    assert _post(served + "/detokenize", {"model": MODEL, "tokens": FRANCE}) == (
        200, {"prompt": "The capital of France is"})
    messages = [{"role": "user", "content": "Name a colour."}]
    status, body = _post(served + "/tokenize", {"model": MODEL, "messages": messages})
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert (status, body["count"]) == (200, reply.usage.prompt_tokens)
    status, body = _post(served + "/detokenize", {"tokens": [10**7]})
    assert (status, body["error"]["type"]) == (400, "invalid_request_error")
    assert "outside the vocabulary" in body["error"]["message"]
