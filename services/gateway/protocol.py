"""OpenAI request bodies → validated GenerateRequest, with OpenAI-shaped errors (pure: no I/O, no aiohttp)."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.errors import ApiError, array_too_long, error_body
from services.gateway.errors import api_type_error as _type_error
from services.gateway.errors import sampling_api_error as _api_error
from services.gateway.errors import unsupported_parameter as _unsupported
from services.gateway.output_format import EXTENSION_PARAMS, checked, parse_output_constraint
from services.gateway.tool_grammar import tool_call_constraint
from services.gateway.tool_request import ToolPolicy, parse_message_tool_calls, parse_tool_request, tool_call_id
from shared.messages import ChatMessage, DetokenizeRequest, GenerateRequest, TokenizeRequest
from shared.sampling import (Bound, SamplingError, SamplingParams, check_bound, check_token_ids, check_value, is_int,
                             range_error, sampling_params)

MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 2048  # prompts in one batched completions call (each is its own request inside)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Accepted for compatibility; they do not change the output.
_IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
            "prompt_cache_retention", "prompt_cache_options", "reasoning_effort", "verbosity",
            "moderation"}
# Every SamplingParams field is a body parameter of both endpoints (OpenAI's, and vLLM-style extensions such as
# top_k); those below the gateway reads itself (max_tokens, logprobs) or maps (top_k -1 → 0).
_SAMPLING = frozenset(SamplingParams.__struct_fields__) - {"is_max_tokens_default",  # set below, not by clients
                                                           "output_constraint"}  # from response_format, guided_*
_SAMPLING_SPECIAL = frozenset({"max_tokens", "logprobs"})
_COMMON = _SAMPLING | {"model", "stream", "stream_options", "stop", "logit_bias", "skip_special_tokens",
                      *EXTENSION_PARAMS}
CHAT_PARAMS = frozenset(_COMMON | _IGNORED | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "audio", "prediction", "web_search_options", "modalities"})
COMPLETION_PARAMS = frozenset(_COMMON | {"prompt", "best_of", "echo", "suffix", "user"})
TOKENIZE_PARAMS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
DETOKENIZE_PARAMS = frozenset({"model", "tokens"})

# Parameters we recognise but cannot honour: any value other than a neutral one is refused.
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "suffix": lambda v: v == "",
}


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: what to send to the tokenizer, and how to shape the answer.

    A completions call with several prompts becomes one GenerateRequest per prompt p, with request id
    `{request_id}-{p}` and the same sampling; choice index p * n + i answers sample i of prompt p."""

    request_id: str
    generates: tuple[GenerateRequest, ...]
    model: str
    is_chat: bool
    is_stream: bool
    include_usage: bool
    is_echo: bool = False  # completions: each choice's text starts with its prompt
    tool_policy: ToolPolicy | None = None  # chat with tools: how its output becomes tool_calls (None: it does not)
    has_prompt_logprobs: bool = False  # the body asked for vLLM's prompt_logprobs field in each choice

    @property
    def generate(self) -> GenerateRequest:
        return self.generates[0]

    @property
    def n(self) -> int:
        return self.generate.sampling.n

    @property
    def has_logprobs(self) -> bool:
        return self.generate.sampling.logprobs is not None


def parse_json_body(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}",
                       code="invalid_json") from None
    except RecursionError:  # NOTE: msgspec raises it for nesting deeper than the interpreter's recursion limit
        raise ApiError(400, "We could not parse the JSON body of your request: it is nested too deeply.",
                       code="invalid_json") from None


def parse_chat_request(body: Any, *, request_id: str, model_ids: Collection[str], default_max_tokens: int,
                       deadline_s: float | None = None, tool_call_parser: str = "auto") -> ParsedRequest:
    """Validate a POST /v1/chat/completions body; raises ApiError on the first problem found."""
    body = _check_envelope(body, CHAT_PARAMS, model_ids, required="messages")
    messages = parse_messages(body["messages"])
    max_tokens = _field(body, "max_completion_tokens", "max_tokens",
                        _field(body, "max_tokens", "max_tokens", default_max_tokens))
    _check_generates(max_tokens, "max_completion_tokens" if body.get("max_completion_tokens") is not None
                     else "max_tokens")
    constraint = parse_output_constraint(body, is_chat=True)
    is_logprobs = _bool(body, "logprobs", False)
    top_logprobs = _field(body, "top_logprobs", "logprobs", None)
    if top_logprobs is not None and not is_logprobs:
        raise ApiError(400, "Invalid value for 'top_logprobs': 'logprobs' must be true when 'top_logprobs' "
                            "is set.", param="top_logprobs", code="invalid_value")
    sampling = _sampling(body, max_tokens, (top_logprobs or 0) if is_logprobs else None)
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        sampling = msgspec.structs.replace(sampling, is_max_tokens_default=True)
    tool_request = parse_tool_request(body.get("tools"), body.get("tool_choice"))
    if tool_request.is_call_required:  # the grammar makes the model call (a named choice: tools is that one)
        if constraint is not None:
            raise ApiError(400, "A structured-output constraint cannot be combined with tool_choice 'required' or a "
                                "named function.", param="tool_choice", code="invalid_value")
        is_parallel = _bool(body, "parallel_tool_calls", True)
        constraint = checked(tool_call_constraint(tool_request.tools, tool_call_parser, is_parallel), "tools")
    sampling = msgspec.structs.replace(sampling, output_constraint=constraint)
    generate = GenerateRequest(request_id, sampling, messages=messages, stop=parse_stop(body.get("stop")),
                               skip_special_tokens=_bool(body, "skip_special_tokens", True), deadline_s=deadline_s,
                               tools=tool_request.tools, is_tool_call_required=tool_request.is_call_required)
    return _parsed(body, request_id, (generate,), is_chat=True, tool_policy=tool_request.policy)


def parse_completion_request(body: Any, *, request_id: str, model_ids: Collection[str],
                             deadline_s: float | None = None) -> ParsedRequest:
    """Validate a POST /v1/completions body; raises ApiError on the first problem found."""
    body = _check_envelope(body, COMPLETION_PARAMS, model_ids, required="prompt")
    prompts = parse_prompts(body["prompt"])
    max_tokens = _field(body, "max_tokens", "max_tokens", SamplingParams().max_tokens)
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, None)
    sampling = _sampling(body, max_tokens, logprobs)
    sampling = msgspec.structs.replace(sampling, output_constraint=parse_output_constraint(body, is_chat=False))
    best_of = _field(body, "best_of", "n", None)
    if best_of is not None and best_of != sampling.n:
        raise _unsupported("best_of")
    is_echo = _bool(body, "echo", False)
    if not (is_echo or sampling.prompt_logprobs is not None):  # max_tokens 0 returns the prompt only
        _check_generates(max_tokens, "max_tokens")
    if is_echo and logprobs is not None:  # the echoed prompt's tokens come with their logprobs (top `logprobs`)
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=max(sampling.prompt_logprobs or 0, logprobs))
    stop, skip_special_tokens = parse_stop(body.get("stop")), _bool(body, "skip_special_tokens", True)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{p}" for p in range(len(prompts))]
    generates = tuple(GenerateRequest(rid, sampling, prompt_text=text, prompt_token_ids=token_ids, stop=stop,
                                      skip_special_tokens=skip_special_tokens, deadline_s=deadline_s)
                      for rid, (text, token_ids) in zip(ids, prompts))
    return _parsed(body, request_id, generates, is_chat=False, is_echo=is_echo)


def parse_tokenize_request(body: Any, *, request_id: str) -> TokenizeRequest:
    """Validate a POST /tokenize body (vLLM's): {prompt, add_special_tokens (default true)} or {messages,
    add_generation_prompt (true only)}; `model`, optional, is checked by the caller."""
    body = _check_fields(body, TOKENIZE_PARAMS, ())
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise ApiError(400, "Exactly one of 'prompt' and 'messages' must be given.", param="prompt",
                       code="invalid_value")
    if body.get("messages") is None:
        if not isinstance(body["prompt"], str):
            raise _type_error("prompt", "a string", body["prompt"])
        return TokenizeRequest(request_id, prompt_text=body["prompt"],
                               add_special_tokens=_bool(body, "add_special_tokens", True))
    for key, supported in (("add_special_tokens", False), ("add_generation_prompt", True)):
        if _bool(body, key, supported) != supported:
            raise ApiError(400, f"Unsupported value: '{key}' must be {str(supported).lower()} with 'messages': "
                                "chat messages are tokenized as a generation would run them.", param=key,
                           code="unsupported_value")
    return TokenizeRequest(request_id, messages=parse_messages(body["messages"]), add_special_tokens=False)


def parse_detokenize_request(body: Any, *, request_id: str) -> DetokenizeRequest:
    """Validate a POST /detokenize body (vLLM's): {tokens}; `model`, optional, is checked by the caller."""
    body = _check_fields(body, DETOKENIZE_PARAMS, ("tokens",))
    return DetokenizeRequest(request_id, _token_ids(body["tokens"], "tokens"))


def parse_messages(value: Any) -> list[ChatMessage]:
    """Chat messages → ChatMessage list; `developer` becomes `system`, text parts are joined by newlines."""
    if not isinstance(value, list):
        raise _type_error("messages", "an array", value)
    if not value:
        raise ApiError(400, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
                            "an empty array instead.", param="messages", code="empty_array")
    return [_parse_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def parse_prompts(value: Any) -> list[tuple[str | None, list[int] | None]]:
    """A completions prompt → one (text, None) or (None, token ids) per prompt: a string or an array of token
    ids is one prompt; an array of strings or of token-id arrays is a batch of them."""
    if isinstance(value, str):
        return [(value, None)]
    if not isinstance(value, list):
        raise _type_error("prompt", "a string or an array", value)
    if not value:
        raise ApiError(400, "Invalid 'prompt': empty array.", param="prompt", code="empty_array")
    if not (all(isinstance(x, str) for x in value) or all(isinstance(x, list) for x in value)):
        return [(None, _token_ids(value, "prompt"))]
    if len(value) > MAX_PROMPTS:
        raise array_too_long("prompt", MAX_PROMPTS, len(value))
    return [(x, None) if isinstance(x, str) else (None, _token_ids(x, f"prompt[{p}]")) for p, x in enumerate(value)]


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, list):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP:
        raise array_too_long("stop", MAX_STOP, len(value))
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise _type_error(f"stop[{i}]", "a string", s)
    return [s for s in value if s]


def _check_envelope(body: Any, allowed: frozenset[str], model_ids: Collection[str], required: str) -> dict:
    body = _check_fields(body, allowed, ("model", required))
    check_model(body["model"], model_ids)
    for key, is_neutral in _NEUTRAL.items():
        if body.get(key) is not None and not is_neutral(body[key]):
            raise _unsupported(key)
    return body


def _check_fields(body: Any, allowed: frozenset[str], required: tuple[str, ...]) -> dict:
    """body as a JSON object of known keys with every required one non-null; else the first problem's ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "Invalid request body: expected a JSON object.", code="invalid_type")
    for key in body:
        if key not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}")
    for key in required:
        if body.get(key) is None:
            raise ApiError(400, f"Missing required parameter: '{key}'.", param=key,
                           code="missing_required_parameter")
    return body


def check_model(model: Any, model_ids: Collection[str]) -> None:
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model not in model_ids:
        raise model_not_found(model)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    code="model_not_found")


def _parsed(body: dict, request_id: str, generates: tuple[GenerateRequest, ...], is_chat: bool,
            is_echo: bool = False, tool_policy: ToolPolicy | None = None) -> ParsedRequest:
    is_stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not is_stream:
        raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options", code="invalid_value")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = _bool(options or {}, "include_usage", False, prefix="stream_options.")
    return ParsedRequest(request_id, generates, body["model"], is_chat, is_stream, include_usage, is_echo,
                         tool_policy, body.get("prompt_logprobs") is not None)


def _check_generates(max_tokens: int, param: str) -> None:
    """max_tokens 0 (no generation) only returns a prompt: a completions call with echo or prompt_logprobs."""
    if max_tokens < 1:
        raise _api_error(range_error(param, "integer", "below minimum", ">= 1", max_tokens))


def _sampling(body: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The body's sampling fields (null meaning the default), checked by SamplingParams' own bounds."""
    values = {k: v for k, v in body.items() if k in _SAMPLING and k not in _SAMPLING_SPECIAL and v is not None}
    try:
        params = sampling_params({**values, "max_tokens": max_tokens, "logprobs": logprobs})
    except SamplingError as exc:
        raise _api_error(exc) from None
    return msgspec.structs.replace(params, top_k=0) if params.top_k < 0 else params  # -1: OpenAI-style "off"


def _parse_message(message: Any, param: str) -> ChatMessage:
    if not isinstance(message, dict):
        raise _type_error(param, "an object", message)
    role = message.get("role")
    if role is None:
        raise ApiError(400, f"Missing required parameter: '{param}.role'.", param=f"{param}.role",
                       code="missing_required_parameter")
    if role not in CHAT_ROLES:
        supported = ", ".join(f"'{r}'" for r in CHAT_ROLES)
        raise ApiError(400, f"Invalid value: {role!r}. Supported values are: {supported}.",
                       param=f"{param}.role", code="invalid_value")
    for key in ("function_call", "audio"):
        if message.get(key):
            raise _unsupported(f"{param}.{key}")
    if message.get("tool_calls") is not None and role != "assistant":
        raise ApiError(400, f"Invalid parameter: '{param}.tool_calls' is only allowed on messages with role "
                            "'assistant'.", param=f"{param}.tool_calls", code="invalid_value")
    tool_calls = parse_message_tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    call_id = tool_call_id(message, param) if role == "tool" else ""
    content = _message_content(message.get("content"), role, f"{param}.content")
    return ChatMessage("system" if role == "developer" else role, content, tool_calls, call_id)


def _message_content(value: Any, role: str, param: str) -> str:
    if value is None:
        if role == "assistant":  # NOTE: one that made tool_calls has no content
            return ""
        raise ApiError(400, f"Missing required parameter: '{param}'.", param=param,
                       code="missing_required_parameter")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _type_error(param, "a string or an array of content parts", value)
    return "\n".join(_text_part(part, f"{param}[{i}]") for i, part in enumerate(value))


def _text_part(part: Any, param: str) -> str:
    if not isinstance(part, dict):
        raise _type_error(param, "an object", part)
    if part.get("type") != "text":
        raise ApiError(400, f"Unsupported value: '{param}.type' does not support {part.get('type')!r} on this "
                            "server; only 'text' content parts are supported.", param=f"{param}.type",
                       code="unsupported_value")
    text = part.get("text")
    if not isinstance(text, str):
        raise _type_error(f"{param}.text", "a string", text)
    return text


def _token_ids(value: Any, param: str) -> list[int]:
    try:
        return check_token_ids(value, param)
    except SamplingError as exc:
        raise _api_error(exc) from None


def _field(body: dict, name: str, field: str, default: Any) -> Any:
    """body[name] checked against the bounds of SamplingParams.<field>, or default if absent."""
    value = body.get(name)
    if value is None:
        return default
    try:
        return check_value(field, value, param=name)
    except SamplingError as exc:
        raise _api_error(exc) from None


def _int(body: dict, name: str, lo: int, hi: int, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise _type_error(name, "an integer", value)
    try:
        check_bound(name, value, Bound(lo, hi), "integer")
    except SamplingError as exc:
        raise _api_error(exc) from None
    return value


def _bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(prefix + name, "a boolean", value)
    return value
