"""`radixserve serve` end to end: the official openai SDK and raw HTTP against the real suite."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_models_lists_the_bundled_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_and_streaming_agree(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_completions_text_and_token_ids(client: openai.OpenAI) -> None:
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
    assert by_text.choices[0].text
    ids = by_text.usage.prompt_tokens
    assert ids > 0
    by_ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=8,
                                       temperature=0)
    assert by_ids.usage.prompt_tokens == 5


def test_seeded_n2_is_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, seed=1234, n=2)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]


def test_stop_string_trims_the_text(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    stop = "Paris"
    stopped = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                             stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs_have_alternatives(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5) for t in content)


def test_repeated_long_prompt_hits_the_prefix_cache(client: openai.OpenAI) -> None:
    system = "You are a careful assistant. " * 40
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * ((again.usage.prompt_tokens - 1) // 16) - 16


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    (json.dumps({"model": MODEL, "messages": QUESTION, "frobnicate": 1}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": QUESTION, "temperature": 9}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": "hello"}).encode(), 400),
    (json.dumps({"model": "no-such-model", "messages": QUESTION}).encode(), 404),
    (json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 0}).encode(), 400),
    (b"x" * (5 << 20), 413),
])
def test_bad_requests_get_openai_errors(served: str, client: openai.OpenAI, body: bytes, status: int) -> None:
    code, payload = _post(served + "/v1/chat/completions", body)
    assert code == status
    assert set(payload["error"]) >= {"message", "type"}
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content is not None


def test_context_length_400_for_max_tokens_and_for_a_long_prompt(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=10**9)
    assert info.value.code == "context_length_exceeded"
    assert re.fullmatch(r"This model's maximum context length is \d+ tokens\. However, you requested 1000000003 "
                        r"tokens \(3 in the messages, 1000000000 in the completion\)\. .*", info.value.body["message"])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[504] * 20000, max_tokens=1)
    assert info.value.code == "context_length_exceeded"



def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI) -> None:
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    forced = client.completions.create(**kwargs, logit_bias={"282": 100})  # " of"
    assert forced.choices[0].text == " of of of"
    plain = client.completions.create(**kwargs)
    assert plain.choices[0].text.startswith(" Paris")
    banned = client.completions.create(**kwargs, logit_bias={"7042": -100})  # " Paris"
    assert not banned.choices[0].text.startswith(" Paris")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs, logit_bias={"282": 101})
    assert (info.value.code, info.value.param) == ("decimal_above_max_value", "logit_bias.282")
