"""The tool-call parser: whole outputs, the same outputs streamed in every split, malformed calls left as content."""
from __future__ import annotations

import itertools
import json

import pytest

from services.gateway.tool_calls import Content, ToolCall, ToolCallParser, merge_events, parse_tool_calls

NAMES = {"get_weather", "get_time"}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
MISTRAL = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "get_time", "arguments": {}}]')
MISTRAL_CALLS = [("call_0", "get_weather", {"city": "Paris"}), ("call_1", "get_time", {})]


def ids() -> callable:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(text: str, parser: str = "auto") -> tuple[str | None, list[tuple[str, str, dict]]]:
    content, calls = parse_tool_calls(text, NAMES, ids(), parser)
    return content, [(c.id, c.name, json.loads(c.arguments)) for c in calls]


def streamed(pieces: list[str], parser: str = "auto") -> list[Content | ToolCall]:
    """The events of pieces fed one by one, adjacent contents merged."""
    tool_parser = ToolCallParser(NAMES, ids(), parser)
    return merge_events([e for piece in pieces for e in tool_parser.feed(piece)] + tool_parser.finish())


def whole(text: str, parser: str = "auto") -> list[Content | ToolCall]:
    return streamed([text], parser)


def test_one_call_with_text_before() -> None:
    assert parse("Let me look.\n" + WEATHER) == (
        "Let me look.", [("call_0", "get_weather", {"city": "Paris", "unit": "°C"})])


def test_several_calls_and_text_between_and_after() -> None:
    content, calls = parse(f"{WEATHER}\n\n{TIME}\nDone.")
    assert content == "Done."
    assert [(c[0], c[1]) for c in calls] == [("call_0", "get_weather"), ("call_1", "get_time")]


def test_calls_alone_leave_content_null_and_arguments_are_compact_json_text() -> None:
    content, calls = parse_tool_calls(f"  {WEATHER} {TIME}\n", NAMES, ids())
    assert content is None
    assert calls[0].arguments == '{"city": "Paris", "unit": "°C"}'
    assert calls[1] == ToolCall("call_1", "get_time", "{}")


def test_no_call_keeps_the_text_exactly() -> None:
    for text in ["", "  hello  \n", "a < b and <tool but not a call", "<tool_cal"]:
        assert parse_tool_calls(text, NAMES, ids()) == (text, [])


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not an offered tool
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>["get_time"]</tool_call>',
    '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
])
def test_malformed_calls_stay_content(bad: str) -> None:
    assert parse(f"Hmm. {bad}") == (f"Hmm. {bad}", [])


def test_a_malformed_call_beside_a_good_one() -> None:
    bad = '<tool_call>{"name": "get_time", "arguments": {</tool_call>'
    assert parse(f"{WEATHER}\n{bad}") == (bad, [("call_0", "get_weather", {"city": "Paris", "unit": "°C"})])


def test_parameters_key_and_string_arguments_are_read() -> None:
    text = ('<tool_call>{"name": "get_time", "parameters": {"tz": "UTC"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>')
    assert parse(text) == (None, [("call_0", "get_time", {"tz": "UTC"}), ("call_1", "get_time", {"tz": "CET"})])


def test_an_unclosed_call_at_the_end_counts_when_complete() -> None:
    assert parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n') == (None, [("call_0", "get_time", {})])
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert parse("x " + cut) == ("x " + cut, [])


def test_llama_json_one_and_several() -> None:
    assert parse('{"name": "get_time", "parameters": {"tz": "UTC"}}') == (None, [("call_0", "get_time", {"tz": "UTC"})])
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert parse(text, "llama3_json") == (None, [("call_0", "get_time", {}), ("call_1", "get_weather", {"city": "Oslo"})])


@pytest.mark.parametrize("text", ['{"name": "get_time", "parameters": {}} and more', '{"answer": 42}', '{"name": "x"',
                                  '{"name": "get_time", "parameters": {}};;'])
def test_llama_json_that_is_not_calls_stays_content(text: str) -> None:
    assert parse(text) == (text, [])


def test_each_parser_reads_only_its_format() -> None:
    llama = '{"name": "get_time", "parameters": {}}'
    assert parse(llama, "hermes") == (llama, [])
    assert parse(TIME, "llama3_json") == (TIME, [])
    assert parse(MISTRAL, "hermes") == (MISTRAL, [])
    assert parse(MISTRAL, "llama3_json") == (MISTRAL, [])
    assert parse(TIME, "mistral") == (TIME, [])
    assert parse(llama, "mistral") == (llama, [])
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallParser(NAMES, ids(), "pythonic")


@pytest.mark.parametrize("parser", ["mistral", "auto"])
def test_mistral_array_after_content(parser: str) -> None:
    assert parse(MISTRAL, parser) == (None, MISTRAL_CALLS)
    assert parse("Let me look.\n" + MISTRAL, parser) == ("Let me look.", MISTRAL_CALLS)
    content, calls = parse_tool_calls(MISTRAL, NAMES, ids(), parser)
    assert calls[0] == ToolCall("call_0", "get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("parser", ["mistral", "auto"])
def test_mistral_array_whose_marker_the_detokenizer_skipped(parser: str) -> None:
    """[TOOL_CALLS] is a special token: with skip_special_tokens (the default) the output is the bare array."""
    assert parse(MISTRAL.removeprefix("[TOOL_CALLS]"), parser) == (None, MISTRAL_CALLS)
    assert parse('[{"name": "get_time", "arguments": {"tz": "UTC"}, "id": "a1b2c3d4e"}]', parser) == (
        None, [("call_0", "get_time", {"tz": "UTC"})])  # the id a v0.3 template writes in the history is ignored


def test_mistral_one_marker_a_call_with_args_marker_and_string_arguments() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    assert parse(text, "mistral") == (None, MISTRAL_CALLS)
    text = ('ok [TOOL_CALLS] [{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}] '
            '[TOOL_CALLS] {"name": "get_time"}')
    assert parse(text, "mistral") == ("ok", [("call_0", "get_time", {"tz": "CET"}), ("call_1", "get_time", {})])


@pytest.mark.parametrize("bad", [
    "[TOOL_CALLS]",
    "[TOOL_CALLS] not json at all",
    "[TOOL_CALLS] []",
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}] and then some text',
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": ]',
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}',  # cut short
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "launch_rockets", "arguments": {}}]',
    '[TOOL_CALLS] [{"name": "get_time", "arguments": [1]}]',
    '[TOOL_CALLS] ["get_time"]',
    "[TOOL_CALLS]get_time[ARGS]oops",
    "[TOOL_CALLS]get_time{}",
    '[TOOL_CALLS]launch_rockets[ARGS]{}',
])
@pytest.mark.parametrize("parser", ["mistral", "auto"])
def test_malformed_mistral_calls_stay_content_and_count_no_call(bad: str, parser: str) -> None:
    assert parse(f"Hmm. {bad}", parser) == (f"Hmm. {bad}", [])
    assert parse(bad, parser) == (bad, [])
    tool_parser = ToolCallParser(NAMES, ids(), parser)
    assert merge_events(tool_parser.feed(bad) + tool_parser.finish()) == [Content(bad)]
    assert tool_parser.num_calls == 0


@pytest.mark.parametrize("text", ['[1, 2, 3]', '[{"a": 1}]', '[ see the note ] then text', '[', ' [TOOL_CAL'])
@pytest.mark.parametrize("parser", ["mistral", "auto"])
def test_arrays_and_brackets_that_are_not_calls_stay_content(text: str, parser: str) -> None:
    assert parse(text, parser) == (text, [])


def test_llama_json_with_a_bad_tail_counts_no_call() -> None:
    """A valid first object followed by garbage is content, and num_calls (finish_reason, required) says so."""
    tool_parser = ToolCallParser(NAMES, ids(), "llama3_json")
    text = '{"name": "get_time", "parameters": {}};;'
    assert merge_events(tool_parser.feed(text) + tool_parser.finish()) == [Content(text)]
    assert tool_parser.num_calls == 0


OUTPUTS = [
    "Sure.\n" + WEATHER + "\n" + TIME + "\nDone!",
    'Hmm <tool_call>{"name": "get_time", "arguments": {</tool_call> ok ' + TIME,
    "plain text with a < sign and <tool_c in it ",
    '  {"name": "get_weather", "parameters": {"city": "Rome"}}',
    '<tool_call>{"name": "get_time", "arguments": {"s": "</tool_call"}}',
]
MISTRAL_OUTPUTS = [
    "Sure, [1] says so.\n" + MISTRAL,
    " " + MISTRAL.removeprefix("[TOOL_CALLS]"),
    '[TOOL_CALLS]get_weather[ARGS]{"city": "[TOOL_CALLS]"}[TOOL_CALLS]get_time[ARGS]{}',
    'Hmm [TOOL_CALLS] [{"name": "get_time", "arguments": {}}] trailing',
    "a [TOOL_C and [TOOL_CALLS",
]
SPLIT_CASES = ([(text, "auto") for text in OUTPUTS + MISTRAL_OUTPUTS]
               + [(text, "mistral") for text in MISTRAL_OUTPUTS])


@pytest.mark.parametrize(("text", "parser"), SPLIT_CASES)
def test_every_split_in_two_and_three_gives_the_whole_outputs_events(text: str, parser: str) -> None:
    expected = whole(text, parser)
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]], parser) == expected, i
    for i, j in itertools.combinations(range(0, len(text) + 1, 3), 2):
        assert streamed([text[:i], text[i:j], text[j:]], parser) == expected, (i, j)


@pytest.mark.parametrize(("text", "parser"), SPLIT_CASES)
def test_one_character_at_a_time_never_shows_markup_as_content(text: str, parser: str) -> None:
    events = streamed(list(text), parser)
    assert events == whole(text, parser)
    calls = [e for e in events if isinstance(e, ToolCall)]
    if calls:  # a stream with valid calls shows none of their markup
        assert all("<tool_call>" not in e.text or "{</tool_call>" in e.text
                   for e in events if isinstance(e, Content))
        assert all("[TOOL_CALLS]" not in e.text for e in events if isinstance(e, Content))


def test_mistral_content_is_released_as_it_comes_and_the_calls_at_the_end() -> None:
    tool_parser = ToolCallParser(NAMES, ids(), "mistral")
    assert tool_parser.feed("Checking [1] ") == [Content("Checking [1]")]
    assert tool_parser.feed("now [TOOL") == [Content(" now")]  # "[TOOL" may start the marker: held
    assert tool_parser.feed('_CALLS] [{"name": "get_time", "arguments": {}}]') == []
    assert tool_parser.finish() == [ToolCall("call_0", "get_time", "{}")]
    auto = ToolCallParser(NAMES, ids(), "auto")
    assert auto.feed("[") == []  # may be the array whose [TOOL_CALLS] was skipped
    assert auto.feed("1] a footnote") == [Content("[1] a footnote")]


def test_content_is_released_as_it_comes_and_a_call_as_soon_as_it_closes() -> None:
    tool_parser = ToolCallParser(NAMES, ids())
    assert tool_parser.feed("Checking the ") == [Content("Checking the")]
    assert tool_parser.feed("weather <tool") == [Content(" weather")]  # "<tool" may start a call: held
    assert tool_parser.feed('_call>{"name": "get_time", ') == []
    assert tool_parser.feed('"arguments": {}}</tool_call>') == [ToolCall("call_0", "get_time", "{}")]
    assert tool_parser.feed(" <tool not a call") == [Content("<tool not a call")]
    assert tool_parser.finish() == []
    assert tool_parser.num_calls == 1
