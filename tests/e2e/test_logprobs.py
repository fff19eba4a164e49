"""`radixserve serve` end to end with the openai SDK: logprob tokens (alternatives included) carry real text and
bytes, and chat logprobs spell exactly the message text."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Name three fruits, with an emoji for each."}]


def assert_real_token(token: str, raw: list[int]) -> None:
    """The token is its bytes as UTF-8, or, for part of a character, "bytes:" and those bytes escaped."""
    assert not token.startswith("token_id:")
    if token.startswith("bytes:"):
        assert token == "bytes:" + bytes(raw).decode("utf-8", "backslashreplace")
    else:
        assert bytes(raw).decode() == token


def test_chat_logprobs_have_real_alternatives_and_spell_the_message(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48, temperature=0,
                                           logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    for item in content:
        assert_real_token(item.token, item.bytes)
        assert len(item.top_logprobs) == 3
        for top in item.top_logprobs:
            assert_real_token(top.token, top.bytes)
    assert content[0].top_logprobs[0].token == content[0].token
    assert bytes(b for item in content for b in item.bytes).decode() == choice.message.content
    assert len(content) == reply.usage.completion_tokens - (choice.finish_reason == "stop")


def test_chat_logprobs_leave_out_the_end_of_turn_token(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=64, temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens - 1  # the end-of-turn token ended it and has no entry
    assert "".join(item.token for item in content) == choice.message.content


def test_streamed_chat_logprobs_spell_the_message(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    text, raw = "", b""
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for item in (choice.logprobs.content or []) if choice.logprobs else []:
            assert_real_token(item.token, item.bytes)
            assert all(not top.token.startswith("token_id:") for top in item.top_logprobs)
            raw += bytes(item.bytes)
    assert text and raw.decode() == text


def test_completion_top_logprobs_are_named_by_text(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer Yes or No:", max_tokens=4,
                                      temperature=0, logprobs=5)
    logprobs = reply.choices[0].logprobs
    assert all(len(top) == 5 for top in logprobs.top_logprobs)
    names = [name for top in logprobs.top_logprobs for name in top]
    assert names and not any(name.startswith("token_id:") for name in names)
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
