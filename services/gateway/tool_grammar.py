"""tool_choice `required` or a named function, enforced: a Lark grammar of the tool-call parser's format whose
calls name an offered function and whose arguments follow that function's parameters schema (pure: no I/O).

    hermes:       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (then "\\n" and more calls)
    llama3_json:  {"name": "f", "parameters": {...}}                                (then "; " and more calls)
    mistral:      [{"name": "f", "arguments": {...}}]                              (more calls after ", " inside)
    (at most MAX_PARALLEL_CALLS calls)
    auto:         any of the three

Mistral's array comes without its `[TOOL_CALLS]` (optionally after one space, as the model writes it after the
marker): the marker is a special token whose id differs between tokenizers and which the default
skip_special_tokens decodes to nothing, and the parser reads an output that starts with the array as its calls.
"""
from __future__ import annotations

import json
from typing import Any

from shared.messages import ToolFunction
from shared.output_constraint import JSON_OPTIONS, ConstraintKind, OutputConstraint

_REF_PREFIXES = ("#/$defs/", "#/definitions/")
# the most calls one answer may hold when parallel_tool_calls is on: a small model, once it may add a call, rarely
# stops adding them before max_tokens (6 of 20 answers of the bundled 135M model ended unbounded), and a call cut
# short is no call; with a bound every answer's calls end, within 4 × the length of one call
MAX_PARALLEL_CALLS = 4


def tool_call_constraint(tools: list[ToolFunction], parser: str, is_parallel: bool = True) -> OutputConstraint:
    """The grammar of one or more calls to these tools (up to MAX_PARALLEL_CALLS; one alone unless is_parallel:
    parallel_tool_calls false), in the parser's format (`auto`: hermes, llama3_json or mistral)."""
    rules = []
    repeat = f"~0..{MAX_PARALLEL_CALLS - 1}"
    if parser in ("hermes", "auto"):
        more = f' ("\\n" hermes_call){repeat}' if is_parallel else ""
        rules.append(f'hermes: hermes_call{more}\n'
                     'hermes_call: "<tool_call>\\n" hermes_body "\\n</tool_call>"\n'
                     f"hermes_body: %json {json.dumps(calls_schema(tools, 'arguments'))}\n")
    if parser in ("llama3_json", "auto"):
        more = f' ("; " llama_body){repeat}' if is_parallel else ""
        rules.append(f'llama: llama_body{more}\n'
                     f"llama_body: %json {json.dumps(calls_schema(tools, 'parameters'))}\n")
    if parser in ("mistral", "auto"):
        more = f' (", " mistral_body){repeat}' if is_parallel else ""
        rules.append(f'mistral: " "? "[" mistral_body{more} "]"\n'
                     f"mistral_body: %json {json.dumps(calls_schema(tools, 'arguments'))}\n")
    start = {"hermes": "hermes", "llama3_json": "llama", "mistral": "mistral"}.get(parser, "hermes | llama | mistral")
    return OutputConstraint(ConstraintKind.LARK, f"start: {start}\n" + "".join(rules))


def calls_schema(tools: list[ToolFunction], arguments_key: str) -> dict[str, Any]:
    """A JSON schema of one call: {"name": one tool's name, arguments_key: that tool's parameters}. Each tool's own
    $defs move to the top, renamed per tool, with its $refs rewritten to match; objects are closed (see _closed)."""
    variants, defs = [], {}
    for i, tool in enumerate(tools):
        parameters = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
        own_defs = {**parameters.pop("definitions", {}), **parameters.pop("$defs", {})}
        prefix = f"tool{i}_"
        defs.update({prefix + name: _closed(_renamed_refs(d, prefix)) for name, d in own_defs.items()})
        variants.append({"type": "object", "properties": {"name": {"const": tool.name},
                                                          arguments_key: _closed(_renamed_refs(parameters, prefix))},
                         "required": ["name", arguments_key], "additionalProperties": False})
    schema: dict[str, Any] = {"anyOf": variants} if len(variants) > 1 else variants[0]
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = JSON_OPTIONS
    return schema


def _closed(value: Any) -> Any:
    """value with additionalProperties false in every object schema that lists properties and says nothing of others
    (as OpenAI's strict function calling reads a schema): a call's arguments are the ones the tool describes."""
    if isinstance(value, list):
        return [_closed(v) for v in value]
    if not isinstance(value, dict):
        return value
    closed = {k: _closed(v) if k != "properties" else {n: _closed(p) for n, p in v.items()} for k, v in value.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _renamed_refs(value: Any, prefix: str) -> Any:
    """value with every local $ref into $defs or definitions pointed at the renamed top-level $defs."""
    if isinstance(value, list):
        return [_renamed_refs(v, prefix) for v in value]
    if not isinstance(value, dict):
        return value
    renamed = {k: _renamed_refs(v, prefix) for k, v in value.items()}
    ref = renamed.get("$ref")
    if isinstance(ref, str):
        for old in _REF_PREFIXES:
            if ref.startswith(old):
                renamed["$ref"] = "#/$defs/" + prefix + ref[len(old):]
    return renamed
