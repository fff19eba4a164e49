"""Structured output at the gateway: response_format and the guided_* extensions → the wire's OutputConstraint, a bad
schema, regex or grammar refused with a 400 before anything is queued, and tool_choice required/named → a grammar
of the parser's format that only well-formed calls to the offered tools satisfy."""
from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import pytest
from llguidance import LLMatcher

from services.gateway.errors import ApiError
from services.gateway.protocol import parse_chat_request, parse_completion_request
from services.gateway.tool_grammar import MAX_PARALLEL_CALLS, tool_call_constraint
from services.tokenizer.model_files import load_bundled_tokenizer
from shared.messages import ToolFunction
from shared.output_constraint import ConstraintKind, OutputConstraint, grammar_text

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
    "$defs": {"City": {"type": "string", "maxLength": 12}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CLOCK_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}


def chat(**body: Any):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return parse_chat_request(body, request_id="r", model_ids=["m"], default_max_tokens=16,
                              tool_call_parser=body.pop("parser", "auto"))


def constraint_of(**body: Any) -> OutputConstraint | None:
    return chat(**body).generate.sampling.output_constraint


def error_of(**body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(**body)
    return info.value


@functools.cache
def _tokenizer():
    """The bundled SmolLM2 tokenizer as llguidance's (any byte-level tokenizer would do: grammars match bytes)."""
    import llguidance.hf

    tokenizer = load_bundled_tokenizer()
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def _matches(constraint: OutputConstraint, text: str) -> bool:
    """Whether text is a whole sentence of the constraint's grammar."""
    tokenizer, lltokenizer = _tokenizer()
    matcher = LLMatcher(lltokenizer, grammar_text(constraint), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_response_formats_become_constraints() -> None:
    named = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}

    assert constraint_of(response_format={"type": "text"}) is None
    assert constraint_of(response_format={"type": "json_object"}) == OutputConstraint(ConstraintKind.JSON_OBJECT)
    assert constraint_of(response_format=named) == OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(
        SCHEMA, separators=(",", ":")))
    assert constraint_of() is None


@pytest.mark.parametrize("body, kind, spec", [
    ({"guided_json": SCHEMA}, ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":"))),
    ({"guided_json": json.dumps(SCHEMA)}, ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA, separators=(",", ":"))),
    ({"guided_regex": "[a-z]+"}, ConstraintKind.REGEX, "[a-z]+"),
    ({"guided_choice": ["yes", "no"]}, ConstraintKind.CHOICE, '["yes","no"]'),
    ({"guided_grammar": 'start: "a"+'}, ConstraintKind.LARK, 'start: "a"+'),
    ({"structured_outputs": {"choice": ["a"]}}, ConstraintKind.CHOICE, '["a"]'),
    ({"structured_outputs": {"json_object": True}}, ConstraintKind.JSON_OBJECT, ""),
])
def test_extensions_become_constraints_on_both_endpoints(body: dict, kind: ConstraintKind, spec: str) -> None:
    completion = parse_completion_request({"model": "m", "prompt": "x", **body}, request_id="r", model_ids=["m"])

    assert constraint_of(**body) == OutputConstraint(kind, spec)
    assert completion.generate.sampling.output_constraint == OutputConstraint(kind, spec)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", "Invalid type: frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema", "/nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", "does not match pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": []}}},
     "response_format.json_schema.schema", "expected an object"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON text"),
    ({"guided_choice": []}, "guided_choice", "non-empty array"),
    ({"guided_choice": ["a", 3]}, "guided_choice[1]", "non-empty string"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "Only one structured-output constraint"),
    ({"response_format": {"type": "json_object"}, "tools": [CLOCK], "tool_choice": "required"}, "tool_choice",
     "cannot be combined"),
])
def test_bad_constraints_are_400s(body: dict, param: str, message: str) -> None:
    error = error_of(**body)

    assert (error.status, error.param) == (400, param)
    assert message in error.message


def test_tool_choice_required_and_named_become_call_grammars() -> None:
    required = constraint_of(tools=[WEATHER, CLOCK], tool_choice="required", parser="hermes")
    named = constraint_of(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                          parser="llama3_json")

    assert required.kind is named.kind is ConstraintKind.LARK
    assert _matches(required, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not _matches(required, 'Sure! <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not _matches(required, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')
    assert not _matches(required, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Llanfairpwllgwyngyll"}}'
                                  '\n</tool_call>')  # longer than the $defs' maxLength
    assert not _matches(required, '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>')
    assert _matches(named, '{"name": "get_time", "parameters": {}}')
    assert not _matches(named, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert constraint_of(tools=[CLOCK], tool_choice="auto") is None


def test_auto_parser_grammar_takes_either_format() -> None:
    constraint = tool_call_constraint([ToolFunction("get_time", "", "")], "auto")

    assert _matches(constraint, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert _matches(constraint, '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}')


def test_mistral_grammar_is_the_array_of_calls_up_to_the_parallel_bound() -> None:
    tools = [ToolFunction("get_time", "", ""),
             ToolFunction("get_weather", "", json.dumps(WEATHER["function"]["parameters"]))]
    constraint = tool_call_constraint(tools, "mistral")
    single = tool_call_constraint(tools, "mistral", is_parallel=False)
    time = '{"name": "get_time", "arguments": {}}'

    for grammar in (constraint, single):
        assert LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar_text(grammar))) == ""
        assert _matches(grammar, f"[{time}]")
        assert _matches(grammar, f" [{time}]")  # the model's space after [TOOL_CALLS]
        assert not _matches(grammar, time)  # no array
        assert not _matches(grammar, f"[{time}] and more")
        assert not _matches(grammar, '[{"name": "get_time", "arguments": {}]')  # malformed JSON
        assert not _matches(grammar, '[{"name": "send_mail", "arguments": {}}]')
        assert not _matches(grammar, '[{"name": "get_weather", "arguments": {"town": "Paris"}}]')
        assert not _matches(grammar, "[TOOL_CALLS]" + f"[{time}]")
        assert not _matches(grammar, f"<tool_call>\n{time}\n</tool_call>")  # another parser's format
    two = f'[{time}, {{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]'
    assert _matches(constraint, two) and not _matches(single, two)
    assert _matches(constraint, "[" + ", ".join([time] * MAX_PARALLEL_CALLS) + "]")
    assert not _matches(constraint, "[" + ", ".join([time] * (MAX_PARALLEL_CALLS + 1)) + "]")
    assert _matches(constraint_of(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {
        "name": "get_time"}}, parser="mistral"), f"[{time}]")


def test_auto_parser_grammar_takes_mistral_arrays_too() -> None:
    constraint = tool_call_constraint([ToolFunction("get_time", "", "")], "auto")

    assert _matches(constraint, '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]')
    assert not _matches(constraint, '[{"name": "get_time", "parameters": {}}]')


def test_tool_arguments_have_no_properties_the_tool_does_not_describe() -> None:
    constraint = tool_call_constraint([ToolFunction("get_time", "", json.dumps(CLOCK_PARAMETERS))], "hermes")

    assert _matches(constraint, '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not _matches(constraint, '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo", "x": 1}}\n'
                                    '</tool_call>')
