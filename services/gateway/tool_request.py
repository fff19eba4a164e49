"""A chat body's `tools`, `tool_choice` and the tool parts of its messages → wire types and the tool policy, with
OpenAI-style 400s (pure: no I/O)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.errors import ApiError, api_type_error, array_too_long
from shared.messages import ChatToolCall, ToolFunction

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPolicy:
    """How a chat request's output is read: calls to these names are parsed into tool_calls; with is_required,
    an output without one is an error (tool_choice "required" or a named function)."""

    names: frozenset[str]
    is_required: bool


@dataclass(frozen=True)
class ToolRequest:
    """The tools to render into the prompt, and the policy for the output (None: no parsing, tool_choice none)."""

    tools: list[ToolFunction]
    policy: ToolPolicy | None

    @property
    def is_call_required(self) -> bool:
        return self.policy is not None and self.policy.is_required


def parse_tool_request(tools_value: Any, choice_value: Any) -> ToolRequest:
    """`tools` and `tool_choice` of a chat body. tool_choice defaults to auto with tools, none without; none
    renders no tools (the model is not shown what it may not call) and parses nothing; a named function renders
    that tool alone."""
    tools = _tools(tools_value)
    choice = "auto" if tools else "none"
    if choice_value is not None:
        choice = _tool_choice(choice_value, {t.name for t in tools})
    if choice == "none" or not tools:
        return ToolRequest([], None)
    if choice in ("auto", "required"):
        return ToolRequest(tools, ToolPolicy(frozenset(t.name for t in tools), choice == "required"))
    return ToolRequest([t for t in tools if t.name == choice], ToolPolicy(frozenset([choice]), True))


def parse_message_tool_calls(value: Any, param: str) -> list[ChatToolCall]:
    """An assistant message's tool_calls: [{id, type: "function", function: {name, arguments}}]."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise api_type_error(param, "an array", value)
    calls = []
    for i, call in enumerate(value):
        at = f"{param}[{i}]"
        _check_object(call, at)
        _check_type(call, at)
        function = call.get("function")
        _check_object(function, f"{at}.function")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise api_type_error(f"{at}.function.arguments", "a string", arguments)
        calls.append(ChatToolCall(_string(call, "id", at), _name(function.get("name"), f"{at}.function.name"),
                                  arguments))
    return calls


def tool_call_id(message: dict, param: str) -> str:
    """A `tool` message's tool_call_id: required, a non-empty string."""
    return _string(message, "tool_call_id", param)


def _tools(value: Any) -> list[ToolFunction]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise api_type_error("tools", "an array", value)
    if len(value) > MAX_TOOLS:
        raise array_too_long("tools", MAX_TOOLS, len(value))
    tools: list[ToolFunction] = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        _check_object(tool, at)
        _check_type(tool, at)
        function = tool.get("function")
        if function is None:
            raise _missing(f"{at}.function")
        _check_object(function, f"{at}.function")
        name = _name(function.get("name"), f"{at}.function.name")
        if any(t.name == name for t in tools):
            raise ApiError(400, f"Invalid 'tools': the function name {name!r} is given more than once.",
                           param=f"{at}.function.name", code="invalid_value")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise api_type_error(f"{at}.function.description", "a string", description)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise api_type_error(f"{at}.function.parameters", "an object (a JSON schema)", parameters)
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise api_type_error(f"{at}.function.strict", "a boolean", function["strict"])
        schema = msgspec.json.encode(parameters).decode() if parameters is not None else ""
        tools.append(ToolFunction(name, description, schema))
    return tools


def _tool_choice(value: Any, names: set[str]) -> str:
    """"none", "auto", "required", or the name of the function a named choice forces."""
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            modes = ", ".join(f"'{m}'" for m in TOOL_CHOICE_MODES)
            raise ApiError(400, f"Invalid value: {value!r}. Supported values are: {modes}, or an object naming a "
                                "function.", param="tool_choice", code="invalid_value")
        choice = value
    else:
        _check_object(value, "tool_choice")
        _check_type(value, "tool_choice")
        function = value.get("function")
        if function is None:
            raise _missing("tool_choice.function")
        _check_object(function, "tool_choice.function")
        choice = _name(function.get("name"), "tool_choice.function.name")
        if names and choice not in names:
            raise ApiError(400, f"Invalid value for 'tool_choice': function {choice!r} is not among the 'tools' "
                                "given.", param="tool_choice", code="invalid_value")
    if choice not in ("none", "auto") and not names:
        raise ApiError(400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                            "specified.", param="tool_choice", code="invalid_value")
    return choice


def _check_object(value: Any, param: str) -> None:
    if not isinstance(value, dict):
        raise api_type_error(param, "an object", value)


def _check_type(value: dict, param: str) -> None:
    kind = value.get("type")
    if kind is None:
        raise _missing(f"{param}.type")
    if kind != "function":
        raise ApiError(400, f"Unsupported value: '{param}.type' does not support {kind!r} on this server; only "
                            "'function' is supported.", param=f"{param}.type", code="unsupported_value")


def _name(value: Any, param: str) -> str:
    if value is None:
        raise _missing(param)
    if not isinstance(value, str):
        raise api_type_error(param, "a string", value)
    if not _NAME.fullmatch(value):
        raise ApiError(400, f"Invalid '{param}': string does not match pattern. Expected a string that matches "
                            "the pattern '^[a-zA-Z0-9_-]{1,64}$'.", param=param, code="invalid_value")
    return value


def _string(obj: dict, key: str, param: str) -> str:
    value = obj.get(key)
    if value is None:
        raise _missing(f"{param}.{key}")
    if not isinstance(value, str):
        raise api_type_error(f"{param}.{key}", "a string", value)
    return value


def _missing(param: str) -> ApiError:
    return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
