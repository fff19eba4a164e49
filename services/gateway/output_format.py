"""A body's structured-output request → an OutputConstraint, checked before anything is queued (pure: no I/O).

Chat's `response_format`: `text`, `json_object`, `json_schema` ({name, schema, strict, description}; the schema is
enforced whether strict is true or not). vLLM's extensions, on chat and completions: `guided_json` (a schema, as an
object or JSON text), `guided_regex`, `guided_choice` (an array of strings), `guided_grammar` (Lark, as llguidance
reads it) and `structured_outputs` ({json | regex | choice | grammar | json_object}). A request has at most one.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from services.gateway.errors import ApiError, api_type_error
from shared.output_constraint import ConstraintError, ConstraintKind, OutputConstraint, check_constraint

EXTENSION_PARAMS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_STRUCTURED_OUTPUTS = {"json": ConstraintKind.JSON_SCHEMA, "regex": ConstraintKind.REGEX,
                       "choice": ConstraintKind.CHOICE, "grammar": ConstraintKind.LARK,
                       "json_object": ConstraintKind.JSON_OBJECT}


def parse_output_constraint(body: dict, is_chat: bool) -> OutputConstraint | None:
    """The body's one output constraint, compiled once to check it; ApiError (400) for a bad or second one."""
    found: list[tuple[str, OutputConstraint]] = []
    if is_chat:
        found += _response_format(body.get("response_format"))
    for param in EXTENSION_PARAMS:
        if body.get(param) is not None:
            found.append(_extension(param, body[param]))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"'{param.split('.')[0]}'" for param, _ in found)
        raise ApiError(400, f"Only one structured-output constraint may be given; this request has {names}.",
                       param=found[1][0].split(".")[0], code="invalid_value")
    param, constraint = found[0]
    return checked(constraint, param)


def checked(constraint: OutputConstraint, param: str) -> OutputConstraint:
    """constraint, or a 400 naming param when its grammar does not compile."""
    try:
        check_constraint(constraint)
    except ConstraintError as exc:
        raise ApiError(400, f"Invalid '{param}': {exc}", param=param, code="invalid_value") from None
    return constraint


def _response_format(value: Any) -> list[tuple[str, OutputConstraint]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise api_type_error("response_format", "an object", value)
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        supported = ", ".join(f"'{k}'" for k in RESPONSE_FORMATS)
        raise ApiError(400, f"Invalid value: {kind!r}. Supported values are: {supported}.",
                       param="response_format.type", code="invalid_value")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", OutputConstraint(ConstraintKind.JSON_OBJECT))]
    spec = value.get("json_schema")
    if spec is None:
        raise _missing("response_format.json_schema")
    if not isinstance(spec, dict):
        raise api_type_error("response_format.json_schema", "an object", spec)
    name = spec.get("name")
    if name is None:
        raise _missing("response_format.json_schema.name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise ApiError(400, "Invalid 'response_format.json_schema.name': string does not match pattern. Expected a "
                            "string that matches the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
                       param="response_format.json_schema.name", code="invalid_value")
    for key, kind_name, expected in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kind_name):
            raise api_type_error(f"response_format.json_schema.{key}", expected, spec[key])
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise api_type_error("response_format.json_schema.schema", "an object", schema)
    return [("response_format.json_schema.schema", _json_schema(schema))]


def _extension(param: str, value: Any) -> tuple[str, OutputConstraint]:
    if param == "guided_json":
        if isinstance(value, str):
            try:
                value = msgspec.json.decode(value)
            except msgspec.DecodeError:
                raise ApiError(400, f"Invalid '{param}': not JSON text.", param=param, code="invalid_value") from None
        if not isinstance(value, dict):
            raise api_type_error(param, "an object (a JSON schema)", value)
        return param, _json_schema(value)
    if param == "guided_choice":
        return param, _choice(param, value)
    if param in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str):
            raise api_type_error(param, "a string", value)
        kind = ConstraintKind.REGEX if param == "guided_regex" else ConstraintKind.LARK
        return param, OutputConstraint(kind, value)
    if not isinstance(value, dict):
        raise api_type_error(param, "an object", value)
    given = [key for key in _STRUCTURED_OUTPUTS if value.get(key) not in (None, False)]
    if len(given) != 1:
        keys = ", ".join(f"'{k}'" for k in _STRUCTURED_OUTPUTS)
        raise ApiError(400, f"Invalid '{param}': give exactly one of {keys}.", param=param, code="invalid_value")
    key = given[0]
    legacy = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    if key == "json_object":
        return f"{param}.json_object", OutputConstraint(ConstraintKind.JSON_OBJECT)
    _, constraint = _extension(legacy[key], value[key])
    return f"{param}.{key}", constraint


def _json_schema(schema: dict) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON_SCHEMA, msgspec.json.encode(schema).decode())


def _choice(param: str, value: Any) -> OutputConstraint:
    if not isinstance(value, list) or not value:
        raise api_type_error(param, "a non-empty array of strings", value)
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise api_type_error(f"{param}[{i}]", "a non-empty string", choice)
    return OutputConstraint(ConstraintKind.CHOICE, msgspec.json.encode(value).decode())


def _missing(param: str) -> ApiError:
    return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
