"""Tool calling through the gateway process with the openai SDK: a scripted tokenizer answers with a Hermes call
split across chunks, so the calls are deterministic (the bundled model's are not)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from shared.messages import ChatMessage, ChatToolCall, GenerateChunk, GenerateError, GenerateRequest, ToolFunction
from tests.service.test_gateway_service import MODEL, FakePeers, GatewayProcess, client, tmp_dir

__all__ = ["tmp_dir"]

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SCRIPTS = {  # the last user message → the output's pieces, one GenerateChunk each
    "call": ["Let me check.", "\n<tool", '_call>\n{"name": "get_', 'weather", "arguments": {"city": "Par',
             'is"}}\n</tool_call>'],
    "chat": ["No tool", " needed."],
}


class ToolPeers(FakePeers):
    def _script(self, req: GenerateRequest) -> list[GenerateChunk | GenerateError]:
        pieces = SCRIPTS.get(req.messages[-1].content if req.messages else "")
        if pieces is None:
            return super()._script(req)
        return [GenerateChunk(req.request_id, i, piece, [100 + k], None, [piece],
                              "stop" if k == len(pieces) - 1 else None, 4, 0)
                for k, piece in enumerate(pieces) for i in range(req.sampling.n)]


@pytest.fixture(scope="module")
def peers(tmp_dir: str) -> Iterator[ToolPeers]:
    fake = ToolPeers(tmp_dir)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def gateway(peers: ToolPeers, tmp_dir: str) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(["--tokenizer-addrs", peers.tokenizer_addr, "--scheduler-addrs", peers.scheduler_addr],
                        Path(tmp_dir) / "tools.log")
    yield gw
    assert gw.stop() == 0


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_a", "content": "unknown city"},
            {"role": "user", "content": prompt}]


@pytest.mark.asyncio
async def test_sdk_whole_call_and_what_the_tokenizer_is_sent(gateway: GatewayProcess, peers: ToolPeers) -> None:
    reply = await client(gateway).chat.completions.create(model=MODEL, messages=_messages("call"), tools=[WEATHER],
                                                          tool_choice="required", n=2)
    for choice in reply.choices:
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Let me check.")
        [call] = choice.message.tool_calls
        assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
            "function", "get_weather", {"city": "Paris"})
        assert call.id.startswith("call_")
    assert reply.choices[0].message.tool_calls[0].id != reply.choices[1].message.tool_calls[0].id
    sent = peers.requests[-1]
    assert (sent.tools, sent.is_tool_call_required) == (
        [ToolFunction("get_weather", "", '{"type":"object","properties":{"city":{"type":"string"}}}')], True)
    assert sent.messages[1:3] == [ChatMessage("assistant", "", [ChatToolCall("call_a", "get_weather", "{}")]),
                                  ChatMessage("tool", "unknown city", tool_call_id="call_a")]


@pytest.mark.asyncio
async def test_sdk_stream_assembles_the_call_and_never_shows_markup(gateway: GatewayProcess) -> None:
    stream = await client(gateway).chat.completions.create(model=MODEL, messages=_messages("call"), tools=[WEATHER],
                                                           stream=True)
    content, calls, finishes = "", {}, []
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                    assert delta.type == "function"
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert content == "Let me check."
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finishes == ["tool_calls"]


@pytest.mark.asyncio
async def test_sdk_auto_without_a_call_and_none_without_parsing(gateway: GatewayProcess, peers: ToolPeers) -> None:
    reply = await client(gateway).chat.completions.create(model=MODEL, messages=_messages("chat"), tools=[WEATHER])
    assert (reply.choices[0].message.content, reply.choices[0].message.tool_calls) == ("No tool needed.", None)
    assert reply.choices[0].finish_reason == "stop"
    reply = await client(gateway).chat.completions.create(model=MODEL, messages=_messages("call"), tools=[WEATHER],
                                                          tool_choice="none")
    assert reply.choices[0].message.content == "".join(SCRIPTS["call"])
    assert (reply.choices[0].message.tool_calls, reply.choices[0].finish_reason) == (None, "stop")
    assert peers.requests[-1].tools == []


@pytest.mark.asyncio
async def test_sdk_required_without_a_call_is_a_clear_error(gateway: GatewayProcess) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await client(gateway).chat.completions.create(model=MODEL, messages=_messages("chat"), tools=[WEATHER],
                                                      tool_choice=named)
    assert info.value.code == "tool_call_not_generated"
    assert "No tool needed." in info.value.message
    stream = await client(gateway).chat.completions.create(model=MODEL, messages=_messages("chat"), tools=[WEATHER],
                                                           tool_choice="required", stream=True)
    with pytest.raises(openai.APIError, match="holds no valid tool call"):
        async for _ in stream:
            pass


@pytest.mark.asyncio
async def test_sdk_bad_tools_are_400(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client(gateway).chat.completions.create(
            model=MODEL, messages=_messages("call"), tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (info.value.code, info.value.param) == ("invalid_value", "tool_choice")
