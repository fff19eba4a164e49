"""Structured output: what a request's output must match (the wire Struct), and its grammar in llguidance's form.

The gateway builds a constraint from the body and checks it here before anything is queued (a bad schema or regex is
a 400); the gpu_worker compiles the same grammar against its tokenizer (services/gpu_worker/structured_output.py).
"""
from __future__ import annotations

import json
from enum import Enum

import msgspec

# JSON is written on one line with OpenAI's separators: flexible whitespace lets a small model pad forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintKind(str, Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # spec: a JSON schema, as JSON text
    REGEX = "regex"  # spec: a regular expression the whole output matches (Rust regex syntax)
    CHOICE = "choice"  # spec: a JSON array of strings; the output is exactly one of them
    LARK = "lark"  # spec: a Lark grammar as llguidance reads it (guided_grammar; tool calls, built by the gateway)


class OutputConstraint(msgspec.Struct, frozen=True):
    """A request's output constraint (protocol 7): frozen, so it keys the worker's grammar cache."""

    kind: ConstraintKind
    spec: str = ""


class ConstraintError(ValueError):
    """The constraint's schema, regex or grammar does not compile; the message says why."""


def grammar_text(constraint: OutputConstraint) -> str:
    """The constraint as an llguidance grammar (the JSON text LLMatcher takes); ConstraintError for a spec that is not
    JSON where JSON is due. Whether the grammar compiles is check_constraint's question."""
    from llguidance import LLMatcher

    kind, spec = constraint.kind, constraint.spec
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(spec)
        if kind is ConstraintKind.CHOICE:
            return LLMatcher.grammar_from_lark(choice_lark(json.loads(spec)))
        return LLMatcher.grammar_from_lark(spec)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ConstraintError(str(exc)) from None


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose only sentences are the choices (as JSON-escaped string literals)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + "\n"


def check_constraint(constraint: OutputConstraint) -> None:
    """ConstraintError when the constraint's grammar does not compile (no tokenizer needed)."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar_text(constraint))
    if is_error:
        raise ConstraintError(messages[0].strip())
