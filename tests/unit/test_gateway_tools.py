"""Gateway pure core for tool calling: tools / tool_choice / tool messages → the GenerateRequest and the policy, and
model outputs → whole and streamed chat bodies with tool_calls."""
from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.protocol import ApiError, parse_chat_request
from services.gateway.responses import RequestOutput, ToolCallStream, chat_response
from services.gateway.tool_request import ToolPolicy
from shared.messages import ChatMessage, ChatToolCall, GenerateChunk, TokenLogprobEntry, ToolFunction

MODEL = "m1"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MISTRAL_CALLS = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')


def chat(**body: Any):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
                              request_id="chatcmpl-1", model_ids=[MODEL], default_max_tokens=64)


WEATHER_WIRE = ToolFunction("get_weather", "Weather of a city", '{"type":"object","properties":{"city":{"type":'
                            '"string"}},"required":["city"]}')


@pytest.mark.parametrize("choice, tools, policy, is_required", [
    (None, [WEATHER_WIRE, ToolFunction("get_time")], ToolPolicy(frozenset({"get_weather", "get_time"}), False), False),
    ("auto", [WEATHER_WIRE, ToolFunction("get_time")], ToolPolicy(frozenset({"get_weather", "get_time"}), False),
     False),
    ("required", [WEATHER_WIRE, ToolFunction("get_time")], ToolPolicy(frozenset({"get_weather", "get_time"}), True),
     True),
    ({"type": "function", "function": {"name": "get_time"}}, [ToolFunction("get_time")],
     ToolPolicy(frozenset({"get_time"}), True), True),
    ("none", [], None, False),
])
def test_tool_choice_sets_the_rendered_tools_and_the_policy(choice, tools, policy, is_required) -> None:
    parsed = chat(tools=[WEATHER, TIME], **({} if choice is None else {"tool_choice": choice}))
    assert (parsed.generate.tools, parsed.generate.is_tool_call_required, parsed.tool_policy) == (
        tools, is_required, policy)


def test_no_tools_means_no_parsing() -> None:
    for body in ({}, {"tools": []}, {"tools": None, "tool_choice": "none"}, {"tool_choice": "auto"}):
        parsed = chat(**body)
        assert (parsed.generate.tools, parsed.tool_policy) == ([], None)


def test_history_with_calls_and_tool_results() -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21 C"}]}]
    parsed = chat(messages=messages, tools=[WEATHER])
    assert parsed.generate.messages == [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", [ChatToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
        ChatMessage("tool", "21 C", tool_call_id="call_1")]


def _output(texts: list[str], finish: str = "stop") -> RequestOutput:
    output = RequestOutput(len(texts))
    for i, text in enumerate(texts):
        output.add(GenerateChunk("r", i, text, [1], finish_reason=finish))
    return output


POLICY = ToolPolicy(frozenset({"get_weather"}), False)


def test_whole_response_with_a_call_and_without() -> None:
    body = chat_response("r", MODEL, 7, _output([f"Checking.\n{CALL}", "No tool needed."]), False, POLICY)
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls"
    assert first["message"]["content"] == "Checking."
    [call] = first["message"]["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert (call["type"], call["function"]) == ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    assert second["message"] == {"role": "assistant", "content": "No tool needed.", "refusal": None}
    assert second["finish_reason"] == "stop"


def test_a_call_cut_by_length_is_content_and_keeps_length() -> None:
    body = chat_response("r", MODEL, 7, _output([CALL[:30]], "length"), False, POLICY)
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == (CALL[:30], "length")
    assert "tool_calls" not in body["choices"][0]["message"]


def test_without_a_policy_the_markup_is_content() -> None:
    body = chat_response("r", MODEL, 7, _output([CALL]), False)
    assert body["choices"][0]["message"]["content"] == CALL


def test_required_without_a_call_is_a_422() -> None:
    with pytest.raises(ApiError) as info:
        chat_response("r", MODEL, 7, _output(["I'd rather chat."]), False, ToolPolicy(frozenset({"get_weather"}), True))
    exc = info.value
    assert (exc.status, exc.code, exc.type) == (422, "tool_call_not_generated", "server_error")
    assert "get_weather" in exc.message and "I'd rather chat." in exc.message


def _stream(pieces: list[str], policy: ToolPolicy = POLICY, has_logprobs: bool = False,
            parser: str = "auto") -> list[dict]:
    stream = ToolCallStream(policy, 1, parser)
    bodies = []
    for k, piece in enumerate(pieces):
        logprobs = [TokenLogprobEntry(k, -0.5, [])] if has_logprobs else None
        chunk = GenerateChunk("r", 0, piece, [k], logprobs, finish_reason="stop" if k == len(pieces) - 1 else None)
        bodies += stream.chat_chunks("r", MODEL, 7, chunk, has_logprobs, False)
    return bodies


def _check_call_deltas(calls: list[dict], arguments: list[str]) -> None:
    """calls are get_weather's, streamed as OpenAI streams them: per call a delta with its index, a distinct call_
    id, the type and the name, then one with its arguments."""
    ids = [delta["tool_calls"][0]["id"] for delta in calls[::2]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(arguments)
    assert calls == [delta for k, (call_id, args) in enumerate(zip(ids, arguments)) for delta in (
        {"tool_calls": [{"index": k, "id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": k, "function": {"arguments": args}}]})]


def test_stream_sends_content_then_the_call_as_openai_does() -> None:
    text = f"Checking.\n{CALL}\n{CALL}"
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    deltas = [(b["choices"][0]["delta"], b["choices"][0]["finish_reason"]) for b in _stream(pieces)]
    assert "".join(d.get("content", "") for d, _ in deltas) == "Checking."
    assert [list(d) for d, _ in deltas[:2]] == [["content"], ["content"]]  # content streams before the calls
    _check_call_deltas([d for d, _ in deltas if "tool_calls" in d], ['{"city": "Paris"}', '{"city": "Paris"}'])
    assert deltas[-1][1] == "tool_calls" and [f for _, f in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert not any("<tool" in d.get("content", "") for d, _ in deltas)


def test_stream_keeps_logprobs_once_per_chunk_and_ends_plain_text_with_stop() -> None:
    bodies = _stream(["Hel", "lo <tool", "s>"], has_logprobs=True)
    assert "".join(b["choices"][0]["delta"].get("content", "") for b in bodies) == "Hello <tools>"
    assert [len(b["choices"][0]["logprobs"]["content"]) for b in bodies] == [1, 1, 1]
    assert bodies[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_required_without_a_call_raises_at_the_end() -> None:
    with pytest.raises(ApiError, match="holds no valid tool call"):
        _stream(["just", " text"], ToolPolicy(frozenset({"get_weather"}), True))


def test_streamed_and_whole_agree() -> None:
    text = f"Sure. {CALL} and {CALL[:20]}"
    whole = chat_response("r", MODEL, 7, _output([text]), False, POLICY)["choices"][0]
    bodies = _stream(list(text))
    content = "".join(b["choices"][0]["delta"].get("content") or "" for b in bodies)
    arguments = [t["function"]["arguments"] for b in bodies for t in b["choices"][0]["delta"].get("tool_calls", [])
                 if "id" not in t]
    assert content == whole["message"]["content"]
    assert arguments == [c["function"]["arguments"] for c in whole["message"]["tool_calls"]]
    assert json.loads(arguments[0]) == {"city": "Paris"}


@pytest.mark.parametrize("parser", ["mistral", "auto"])
def test_mistral_calls_stream_as_openai_does_and_agree_with_the_whole_response(parser: str) -> None:
    text = f"Checking.\n{MISTRAL_CALLS}"
    deltas = [(b["choices"][0]["delta"], b["choices"][0]["finish_reason"])
              for b in _stream([text[i:i + 5] for i in range(0, len(text), 5)], parser=parser)]
    assert "".join(d.get("content", "") for d, _ in deltas) == "Checking."
    _check_call_deltas([d for d, _ in deltas if "tool_calls" in d], ['{"city": "Paris"}', '{"city": "Oslo"}'])
    assert deltas[-1][1] == "tool_calls"
    assert not any("[TOOL" in d.get("content", "") for d, _ in deltas)
    message = chat_response("r", MODEL, 7, _output([text]), False, POLICY, parser)["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}', '{"city": "Oslo"}']


def test_required_with_a_mistral_array_holding_a_bad_call_is_an_error_and_content_stays() -> None:
    required = ToolPolicy(frozenset({"get_weather"}), True)
    bad = MISTRAL_CALLS.replace('"Oslo"}}', '"Oslo"}}, {"name": "launch_rockets", "arguments": {}}')
    with pytest.raises(ApiError, match="holds no valid tool call"):
        _stream([bad[:40], bad[40:]], required, parser="mistral")
    body = chat_response("r", MODEL, 7, _output([bad]), False, POLICY, "mistral")["choices"][0]
    assert (body["message"]["content"], body["message"].get("tool_calls"), body["finish_reason"]) == (bad, None, "stop")
