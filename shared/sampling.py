"""The sampling parameters of a request, defined and validated once: the gateway builds them from a request body,
the wire carries them, and the gpu_worker's engine samples with them.

Each field's bounds sit beside it (`Annotated[..., Bound(...)]`); `check_value` and `SamplingParams.check` are the
only validation, and their `SamplingError` carries an OpenAI-shaped message, param and code.
"""
from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from shared.output_constraint import OutputConstraint

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_LOGPROBS = 20
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_BOUND = 100.0


@dataclass(frozen=True)
class Bound:
    """The closed range [lo, hi] a number must lie in; (lo, hi] when is_lo_open."""

    lo: float
    hi: float
    is_lo_open: bool = False


class SamplingError(ValueError):
    """A sampling value of the wrong type or out of its bounds; the gateway answers it with an OpenAI 400."""

    def __init__(self, param: str, message: str, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


class SamplingParams(msgspec.Struct, frozen=True):
    """Per-request decoding settings, with OpenAI/vLLM meanings; the wire form and the engine's.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    repetition_penalty (HF/CTRL style, 1 = off) divides positive / multiplies negative logits of tokens
    seen in prompt or output; presence/frequency penalties (OpenAI style, 0 = off) apply to output tokens.
    logit_bias is added to a row's logits before penalties, temperature, filters and the greedy argmax.
    NOTE: field names and defaults are the wire format (protocol 1): rename or re-default none of them.
    """

    max_tokens: Annotated[int, Bound(0, INT32_MAX)] = 16  # 0: no generation (prompt logprobs, echo); see the gateway
    temperature: Annotated[float, Bound(0.0, 2.0)] = 1.0
    top_p: Annotated[float, Bound(0.0, 1.0, is_lo_open=True)] = 1.0
    top_k: Annotated[int, Bound(-1, INT32_MAX)] = 0
    min_p: Annotated[float, Bound(0.0, 1.0)] = 0.0
    presence_penalty: Annotated[float, Bound(-2.0, 2.0)] = 0.0
    frequency_penalty: Annotated[float, Bound(-2.0, 2.0)] = 0.0
    repetition_penalty: Annotated[float, Bound(0.0, math.inf, is_lo_open=True)] = 1.0
    seed: Annotated[int | None, Bound(INT64_MIN, INT64_MAX)] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: Annotated[int, Bound(1, MAX_N)] = 1
    logprobs: Annotated[int | None, Bound(0, MAX_LOGPROBS)] = None  # None: none; k: the chosen token's + top k
    # (token id, bias in [-100, 100]) pairs added to the logits before any filter (OpenAI's dict, as pairs)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Set by the gateway when the body named no max_tokens (chat's default ceiling): a worker then clips max_tokens to
    # the context the prompt leaves, as OpenAI does, instead of refusing with context_length_exceeded. Not a body field.
    is_max_tokens_default: bool = False
    # vLLM's prompt_logprobs: None: none; k: each prompt token's logprob given the tokens before it, and the top k
    # (the first prompt token has none). The engine computes them during prefill; see docs/ARCHITECTURE.md.
    prompt_logprobs: Annotated[int | None, Bound(0, MAX_LOGPROBS)] = None
    # Structured output (protocol 7): the output's grammar, built and checked by the gateway (output_constraint.py)
    output_constraint: OutputConstraint | None = None
    # Speculative decoding (a worker started with --speculative-method): False decodes this request plainly. The
    # output is the same either way for greedy requests; a body field (a vLLM-style extension)
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> SamplingParams:
        """self, or SamplingError for the first field of the wrong type or out of its bounds."""
        for name in SamplingParams.__struct_fields__:
            check_value(name, getattr(self, name))
        return self


def sampling_params(values: Mapping[str, Any], params: Mapping[str, str] | None = None) -> SamplingParams:
    """SamplingParams from raw (e.g. JSON) values by field name, each checked; params names a field in errors
    where the caller's name for it differs (e.g. max_tokens given as max_completion_tokens)."""
    params = params or {}
    return SamplingParams(**{name: check_value(name, value, params.get(name, name)) for name, value in values.items()})


def check_value(name: str, value: Any, param: str | None = None) -> Any:
    """value as field `name` holds it (ints as floats for decimals, token ids as a tuple), or SamplingError."""
    param = param or name
    hint = _HINTS[name]
    kind, bound = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint, None)
    if value is None and _is_optional(kind):
        return None
    if name == "output_constraint":  # not a body field: the gateway builds it, the worker compiles it
        return value
    if kind == tuple[int, ...]:
        return tuple(check_token_ids(value, param, allow_empty=True))
    if kind == tuple[tuple[int, float], ...]:
        return check_logit_bias(value, param)
    if kind is bool:
        if not isinstance(value, bool):
            raise type_error(param, "a boolean", value)
        return value
    is_decimal = kind is float
    if not (is_int(value) or (is_decimal and isinstance(value, float) and math.isfinite(value))):
        raise type_error(param, "a decimal" if is_decimal else "an integer", value)
    check_bound(param, value, bound, "decimal" if is_decimal else "integer")
    return float(value) if is_decimal else value


def check_bound(param: str, value: float, bound: Bound | None, kind: str) -> None:
    """SamplingError unless value lies within bound (kind, "integer" or "decimal", names it in the message)."""
    if bound is None:
        return
    if value < bound.lo or (bound.is_lo_open and value == bound.lo):
        lo = f"> {_fmt(bound.lo)}" if bound.is_lo_open else f">= {_fmt(bound.lo)}"
        raise range_error(param, kind, "below minimum", lo, value)
    if value > bound.hi:
        raise range_error(param, kind, "above maximum", f"<= {_fmt(bound.hi)}", value)


def check_token_ids(value: Any, param: str, allow_empty: bool = False) -> list[int]:
    """value as a list of token ids (ints in [0, INT32_MAX]), or SamplingError."""
    if not isinstance(value, (list, tuple)):
        raise type_error(param, "an array of integers", value)
    if not value and not allow_empty:
        raise SamplingError(param, f"Invalid '{param}': empty array.", "empty_array")
    for i, token_id in enumerate(value):
        if not is_int(token_id):
            raise type_error(f"{param}[{i}]", "an integer", token_id)
        if not 0 <= token_id <= INT32_MAX:
            raise SamplingError(f"{param}[{i}]", f"Invalid '{param}[{i}]': {token_id} is not a valid token id.",
                                "invalid_value")
    return list(value)


def check_logit_bias(value: Any, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}; JSON keys are strings) or its pairs → sorted (id, bias) pairs."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise type_error(param, "an object", value)
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingError(param, f"Invalid '{param}': too many entries. Expected at most {MAX_LOGIT_BIAS_ENTRIES}, "
                                   f"but got {len(items)} instead.", "too_many_entries")
    pairs: dict[int, float] = {}
    for key, bias in items:
        token_id = _token_id_key(key)
        if token_id is None:
            raise SamplingError(param, f"Invalid '{param}': {key!r} is not a valid token id.", "invalid_value")
        name = f"{param}.{token_id}"
        if not (is_int(bias) or (isinstance(bias, float) and math.isfinite(bias))):
            raise type_error(name, "a number", bias)
        check_bound(name, bias, Bound(-LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND), "decimal")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


def check_logit_bias_ids(logit_bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """SamplingError for the first logit_bias token id outside the vocabulary [0, vocab_size) (OpenAI's 400)."""
    bad = next((token_id for token_id, _ in logit_bias if token_id >= vocab_size), None)
    if bad is not None:
        raise SamplingError("logit_bias", f"Invalid key in 'logit_bias': {bad}. Maximum value is {vocab_size - 1}.",
                            "invalid_value")


def _token_id_key(key: Any) -> int | None:
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    return key if is_int(key) and 0 <= key <= INT32_MAX else None


def context_length_error(max_context_tokens: int, num_prompt_tokens: int, max_tokens: int) -> SamplingError:
    """OpenAI's 400 for a prompt plus max_tokens that do not fit in the model's context."""
    return SamplingError("messages", f"This model's maximum context length is {max_context_tokens} tokens. However, "
                                     f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                                     f"the messages, {max_tokens} in the completion). Please reduce the length of "
                                     "the messages or completion.", CONTEXT_LENGTH_EXCEEDED)


def prompt_length_error(max_prompt_tokens: int, num_prompt_tokens: int) -> SamplingError:
    """The 400 for a prompt longer than a server's prompt limit (known before the model's context is)."""
    return SamplingError("messages", f"This server's maximum prompt length is {max_prompt_tokens} tokens. However, "
                                     f"your prompt has {num_prompt_tokens} tokens. Please reduce the length of the "
                                     "messages.", CONTEXT_LENGTH_EXCEEDED)


def type_error(param: str, expected: str, value: Any) -> SamplingError:
    return SamplingError(param, f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} "
                                "instead.", "invalid_type")


def range_error(param: str, kind: str, where: str, bound: str, value: Any) -> SamplingError:
    code = f"{kind}_{where.replace(' ', '_').replace('minimum', 'min').replace('maximum', 'max')}_value"
    return SamplingError(param, f"Invalid '{param}': {kind} {where} value. Expected a value {bound}, but got "
                                f"{value} instead.", code)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string", list: "an array",
             tuple: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _is_optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_HINTS = typing.get_type_hints(SamplingParams, include_extras=True)
