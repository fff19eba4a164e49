"""Chat messages and tools → what the chat template renders: the template's own tool support when it has one
(`tools=` and OpenAI-shaped `tool_calls` / `tool` messages), else a fallback in plain messages.

The fallback (Hermes/Qwen style, as the gateway's `hermes` parser reads it): a system prompt that lists the tools
as JSON in `<tools></tools>` and asks for each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
an assistant's earlier calls are written the same way after its content, and a `tool` message becomes a user
message `<tool_response>…</tool_response>` (consecutive ones one message, as Qwen's template groups them, so a
template that wants user and assistant turns to alternate, such as Mixtral's, still renders). Everything then
travels as message content, so the special-token guard of chat_prompt applies to it as to any content.

Mistral's templates (7B v0.3, Mixtral 8x22B, Nemo: tools rendered as `[AVAILABLE_TOOLS]`, calls as `[TOOL_CALLS]`)
refuse a call id that is not 9 letters and digits, and OpenAI's ids (`call_…`) are longer: for them each id is
rewritten to 9 alphanumerics derived from it, the same in a call and in its result, so a history keeps its pairs.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import jinja2

from services.tokenizer.model_files import Tokenizer
from shared.messages import ChatMessage, ChatToolCall, ToolFunction

FALLBACK_INTRO = ("You may call one or more functions to assist with the user query. The functions available are "
                  "described as JSON schemas within <tools></tools>:")
FALLBACK_FORMAT = ("For each function call, answer with a JSON object holding the function's name and arguments "
                   "within <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call>")
FALLBACK_REQUIRED = "You must answer with at least one function call."
MISTRAL_CALLS_TOKEN = "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHANUMERICS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}


def template_inputs(tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[ToolFunction],
                    is_call_required: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template: tools is None when there are none, or when the template has no
    tool support and the fallback wrote them into the messages."""
    has_tool_parts = any(m.tool_calls or m.role == "tool" for m in messages)
    if not tools and not has_tool_parts:
        return [{"role": m.role, "content": m.content} for m in messages], None
    if supports_tools(tokenizer):
        call_id = mistral_call_id if has_mistral_call_ids(tokenizer) else str
        return [_native_message(m, call_id) for m in messages], [openai_tool(t) for t in tools] or None
    dicts = _fallback_messages(messages)
    if tools:
        dicts = _with_system_prompt(dicts, fallback_system_prompt(tools, is_call_required))
    return dicts, None


@lru_cache(maxsize=8)
def supports_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders tools: a probe conversation renders differently with a tool than without."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                  tokenize=False)
        without = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError):
        return False
    return with_tool != without


def has_mistral_call_ids(tokenizer: Tokenizer) -> bool:
    """Whether the chat template is one of Mistral's (it writes calls after [TOOL_CALLS]): its call ids are 9
    alphanumerics."""
    return MISTRAL_CALLS_TOKEN in str(tokenizer.chat_template or "")


def mistral_call_id(call_id: str) -> str:
    """call_id as Mistral's templates take it: itself when it is 9 alphanumerics, else 9 derived from its hash."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHANUMERICS))
        digits.append(_ALPHANUMERICS[digit])
    return "".join(digits)


def fallback_system_prompt(tools: list[ToolFunction], is_call_required: bool) -> str:
    listed = "\n".join(json.dumps(openai_tool(t), ensure_ascii=False) for t in tools)
    required = f"\n{FALLBACK_REQUIRED}" if is_call_required else ""
    return f"# Tools\n\n{FALLBACK_INTRO}\n<tools>\n{listed}\n</tools>\n\n{FALLBACK_FORMAT}{required}"


def openai_tool(tool: ToolFunction) -> dict[str, Any]:
    """A tool as OpenAI's request gives it (transformers' templates read this shape)."""
    function: dict[str, Any] = {"name": tool.name, "description": tool.description}
    if tool.parameters:
        function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


def outside_content_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The text a template renders from the inputs other than contents (tools, calls): checked for special tokens."""
    calls = [m.get("tool_calls") for m in messages if m.get("tool_calls")]
    ids = [m.get("tool_call_id", "") for m in messages]
    return json.dumps([tools, calls, ids], ensure_ascii=False)


def _native_message(message: ChatMessage, call_id: Callable[[str], str] = str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call_id(c.id), "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c)}} for c in message.tool_calls]
    if message.role == "tool":
        out["tool_call_id"] = call_id(message.tool_call_id)
    return out


def _fallback_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages in plain roles; a run of tool results is one user message."""
    dicts: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        out = _fallback_message(message)
        if message.role == "tool" and i and messages[i - 1].role == "tool":
            dicts[-1] = {"role": "user", "content": dicts[-1]["content"] + "\n" + out["content"]}
        else:
            dicts.append(out)
    return dicts


def _fallback_message(message: ChatMessage) -> dict[str, str]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.content}\n</tool_response>"}
    calls = "\n".join(_fallback_call(c) for c in message.tool_calls)
    content = "\n".join(part for part in (message.content, calls) if part)
    return {"role": message.role, "content": content}


def _fallback_call(call: ChatToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _arguments(call: ChatToolCall) -> Any:
    """The call's arguments as an object (templates write them with tojson); text that is no JSON stays text."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _with_system_prompt(messages: list[dict[str, str]], prompt: str) -> list[dict[str, str]]:
    """The tools prompt after the first system message's content, or as a new first system message."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{prompt}" if first else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
