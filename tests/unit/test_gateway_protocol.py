"""Gateway pure core: OpenAI bodies → GenerateRequest with exact errors, and exact response bodies."""
from __future__ import annotations

from typing import Any

import pytest

from services.gateway.protocol import (ApiError, parse_chat_request, parse_completion_request, parse_json_body,
                                       parse_detokenize_request, parse_prompts, parse_stop, parse_tokenize_request)
from services.gateway.responses import (RequestOutput, chat_chunk, chat_response, chat_role_chunk,
                                        completion_chunk, completion_response, usage_chunk)
from shared.messages import (ChatMessage, DetokenizeRequest, GenerateChunk, GenerateRequest, SamplingSpec,
                             TokenizeRequest, TokenLogprobEntry)

MODEL = "m1"
USER = [{"role": "user", "content": "hi"}]


def chat(**body: Any):
    return parse_chat_request({"model": MODEL, "messages": USER, **body}, request_id="chatcmpl-1",
                              model_ids=[MODEL], default_max_tokens=1024, deadline_s=99.0)


def completion(**body: Any):
    return parse_completion_request({"model": MODEL, "prompt": "hello", **body}, request_id="cmpl-1",
                                    model_ids=[MODEL], deadline_s=None)


def error_of(fn, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(**body)
    return info.value


# --- chat parsing ---

def test_minimal_chat_request() -> None:
    parsed = chat()
    default = SamplingSpec(max_tokens=1024, is_max_tokens_default=True)
    assert parsed.generate == GenerateRequest("chatcmpl-1", default,
                                              messages=[ChatMessage("user", "hi")], deadline_s=99.0)
    assert (parsed.model, parsed.is_chat, parsed.is_stream, parsed.include_usage) == (MODEL, True, False, False)
    assert parsed.has_logprobs is False


def test_chat_sampling_fields_map_to_sampling_spec() -> None:
    parsed = chat(max_tokens=7, temperature=0.5, top_p=0.9, n=3, presence_penalty=-1, frequency_penalty=1.5,
                  seed=42, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, stop_token_ids=[2, 3],
                  stop=["a", "b"], skip_special_tokens=False, user="u", metadata={"k": "v"}, store=False)
    assert parsed.generate.sampling == SamplingSpec(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=-1.0,
        frequency_penalty=1.5, repetition_penalty=1.2, seed=42, stop_token_ids=(2, 3), ignore_eos=True, n=3)
    assert parsed.generate.stop == ["a", "b"]
    assert parsed.generate.skip_special_tokens is False


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).generate.sampling.max_tokens == 9
    assert chat(max_completion_tokens=3).generate.sampling.max_tokens == 3


def test_null_values_mean_default() -> None:
    parsed = chat(temperature=None, n=None, stop=None, tools=None, logprobs=None, stream=None)
    assert parsed.generate.sampling == SamplingSpec(max_tokens=1024, is_max_tokens_default=True)


def test_top_k_minus_one_disables() -> None:
    assert chat(top_k=-1).generate.sampling.top_k == 0


def test_messages_roles_and_content_parts() -> None:
    parsed = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": None},
    ])
    assert parsed.generate.messages == [ChatMessage("system", "be brief"), ChatMessage("system", "a\nb"),
                                        ChatMessage("user", "q"), ChatMessage("assistant", "")]


def test_chat_logprobs_mapping() -> None:
    assert chat(logprobs=True).generate.sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).generate.sampling.logprobs == 20
    assert chat(logprobs=False).generate.sampling.logprobs is None
    assert chat(logprobs=True).has_logprobs is True


def test_stream_and_include_usage() -> None:
    parsed = chat(stream=True, stream_options={"include_usage": True})
    assert (parsed.is_stream, parsed.include_usage) == (True, True)
    assert chat(stream=True).include_usage is False


def test_neutral_values_of_unsupported_parameters_are_accepted() -> None:
    parsed = chat(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={},
                  modalities=["text"], parallel_tool_calls=False)
    assert parsed.generate.sampling == SamplingSpec(max_tokens=1024, is_max_tokens_default=True)


def test_logit_bias_becomes_sorted_token_id_pairs() -> None:
    parsed = chat(logit_bias={"42": 100, "7": -100, "3": 0.5})
    assert parsed.generate.sampling.logit_bias == ((3, 0.5), (7, -100.0), (42, 100.0))
    assert chat(logit_bias={str(i): 1 for i in range(300)}).generate.sampling.logit_bias[-1] == (299, 1.0)


# --- completions parsing ---

def test_minimal_completion_request() -> None:
    parsed = completion()
    assert parsed.generate == GenerateRequest("cmpl-1", SamplingSpec(max_tokens=16), prompt_text="hello")
    assert parsed.is_chat is False


def test_completion_logprobs_and_best_of_equal_to_n() -> None:
    parsed = completion(logprobs=3, n=2, best_of=2, echo=False, suffix=None)
    assert (parsed.generate.sampling.logprobs, parsed.generate.sampling.n) == (3, 2)
    assert completion(logprobs=0).generate.sampling.logprobs == 0


@pytest.mark.parametrize("prompt, expected", [
    ("abc", [("abc", None)]),
    ("", [("", None)]),
    (["abc"], [("abc", None)]),
    ([1, 2, 3], [(None, [1, 2, 3])]),
    ([[4, 5]], [(None, [4, 5])]),
    (["a", "", "c"], [("a", None), ("", None), ("c", None)]),
    ([[4, 5], [6]], [(None, [4, 5]), (None, [6])]),
])
def test_prompt_forms(prompt: Any, expected: list) -> None:
    assert parse_prompts(prompt) == expected


def test_batched_prompts_become_one_generation_each() -> None:
    parsed = completion(prompt=[[1, 2], [3]], n=2, max_tokens=5, stop="x")
    sampling = SamplingSpec(max_tokens=5, n=2)
    assert parsed.request_id == "cmpl-1"
    assert parsed.generates == (GenerateRequest("cmpl-1-0", sampling, prompt_token_ids=[1, 2], stop=["x"]),
                                GenerateRequest("cmpl-1-1", sampling, prompt_token_ids=[3], stop=["x"]))
    assert [g.request_id for g in completion(prompt=["a"]).generates] == ["cmpl-1"]


def test_echo_without_logprobs_is_accepted() -> None:
    assert completion(echo=True).is_echo is True
    assert completion(echo=False).is_echo is False


@pytest.mark.parametrize("stop, expected", [(None, []), ("x", ["x"]), ("", []), (["a", "", "b"], ["a", "b"]),
                                            ([], [])])
def test_stop_forms(stop: Any, expected: list[str]) -> None:
    assert parse_stop(stop) == expected


# --- errors ---

@pytest.mark.parametrize("body, status, param, code, fragment", [
    ({"temperature": 2.5}, 400, "temperature", "decimal_above_max_value",
     "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5 instead."),
    ({"temperature": -0.1}, 400, "temperature", "decimal_below_min_value", "Expected a value >= 0"),
    ({"temperature": "hot"}, 400, "temperature", "invalid_type",
     "Invalid type for 'temperature': expected a decimal, but got a string instead."),
    ({"top_p": 0}, 400, "top_p", "decimal_below_min_value", "Expected a value > 0, but got 0"),
    ({"top_p": 1.01}, 400, "top_p", "decimal_above_max_value", "Expected a value <= 1"),
    ({"n": 0}, 400, "n", "integer_below_min_value", "Expected a value >= 1, but got 0"),
    ({"n": 17}, 400, "n", "integer_above_max_value", "Expected a value <= 16, but got 17"),
    ({"n": 1.5}, 400, "n", "invalid_type", "expected an integer, but got a decimal"),
    ({"n": True}, 400, "n", "invalid_type", "expected an integer, but got a boolean"),
    ({"max_tokens": 0}, 400, "max_tokens", "integer_below_min_value", "Expected a value >= 1"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens", "integer_below_min_value", ">= 1"),
    ({"presence_penalty": 2.1}, 400, "presence_penalty", "decimal_above_max_value", "<= 2"),
    ({"frequency_penalty": -3}, 400, "frequency_penalty", "decimal_below_min_value", ">= -2"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "integer_above_max_value", "<= 20"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "invalid_value", "'logprobs' must be true"),
    ({"logprobs": 1}, 400, "logprobs", "invalid_type", "expected a boolean"),
    ({"min_p": 1.5}, 400, "min_p", "decimal_above_max_value", "<= 1"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", "decimal_below_min_value", "> 0"),
    ({"top_k": -2}, 400, "top_k", "integer_below_min_value", ">= -1"),
    ({"ignore_eos": "yes"}, 400, "ignore_eos", "invalid_type", "expected a boolean"),
    ({"stop_token_ids": [1, -1]}, 400, "stop_token_ids[1]", "invalid_value", "not a valid token id"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "array_above_max_length", "maximum length 4"),
    ({"stop": [1]}, 400, "stop[0]", "invalid_type", "expected a string, but got an integer"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value",
     "only allowed when 'stream' is enabled"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage",
     "invalid_type", "expected a boolean"),
    ({"seed": 2**64}, 400, "seed", "integer_above_max_value", "<= 9223372036854775807"),
    ({"foo": 1}, 400, None, None, "Unrecognized request argument supplied: foo"),
    ({"echo": True}, 400, None, None, "Unrecognized request argument supplied: echo"),
    ({"tools": {"name": "f"}}, 400, "tools", "invalid_type", "expected an array, but got an object"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, 400, "tools", "array_above_max_length",
     "maximum length 128"),
    ({"tools": [{"function": {"name": "f"}}]}, 400, "tools[0].type", "missing_required_parameter", "'tools[0].type'"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, 400, "tools[0].type", "unsupported_value",
     "only 'function' is supported"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0].function", "missing_required_parameter", "'tools[0].function'"),
    ({"tools": [{"type": "function", "function": {"description": "d"}}]}, 400, "tools[0].function.name",
     "missing_required_parameter", "'tools[0].function.name'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, 400, "tools[0].function.name",
     "invalid_value", "does not match pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, 400,
     "tools[0].function.parameters", "invalid_type", "expected an object (a JSON schema), but got a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, 400,
     "tools[0].function.description", "invalid_type", "expected a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, 400,
     "tools[0].function.strict", "invalid_type", "expected a boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools[1].function.name",
     "invalid_value", "'f' is given more than once"),
    ({"tool_choice": "required"}, 400, "tool_choice", "invalid_value",
     "'tool_choice' is only allowed when 'tools' are specified."),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice", "invalid_value",
     "only allowed when 'tools' are specified"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, 400, "tool_choice",
     "invalid_value", "Invalid value: 'always'. Supported values are: 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
     400, "tool_choice", "invalid_value", "function 'g' is not among the 'tools' given"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}, 400,
     "tool_choice.function", "missing_required_parameter", "'tool_choice.function'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": 3}, 400, "tool_choice",
     "invalid_type", "expected an object"),
    ({"logit_bias": {"x": 5}}, 400, "logit_bias", "invalid_value", "'x' is not a valid token id"),
    ({"logit_bias": {"-1": 5}}, 400, "logit_bias", "invalid_value", "'-1' is not a valid token id"),
    ({"logit_bias": {"7": 101}}, 400, "logit_bias.7", "decimal_above_max_value", "<= 100, but got 101"),
    ({"logit_bias": {"7": -100.5}}, 400, "logit_bias.7", "decimal_below_min_value", ">= -100, but got -100.5"),
    ({"logit_bias": {"7": "1"}}, 400, "logit_bias.7", "invalid_type", "expected a number, but got a string"),
    ({"logit_bias": [1, 2]}, 400, "logit_bias", "invalid_type", "expected an object, but got an array"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", "too_many_entries", "at most 300"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format.json_schema.name",
     "missing_required_parameter", "Missing required parameter: 'response_format.json_schema.name'."),
    ({"response_format": {"type": "xml"}}, 400, "response_format.type", "invalid_value",
     "Supported values are: 'text', 'json_object', 'json_schema'."),
    ({"model": "other"}, 404, None, "model_not_found", "The model `other` does not exist"),
    ({"model": 3}, 400, "model", "invalid_type", "expected a string, but got an integer"),
    ({"model": None}, 400, "model", "missing_required_parameter", "Missing required parameter: 'model'."),
    ({"messages": None}, 400, "messages", "missing_required_parameter", "Missing required parameter: 'messages'."),
    ({"messages": []}, 400, "messages", "empty_array", "empty array"),
    ({"messages": "hi"}, 400, "messages", "invalid_type", "expected an array, but got a string"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role", "missing_required_parameter", "'messages[0].role'"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, 400, "messages[0].role", "invalid_value",
     "Invalid value: 'function'. Supported values are: 'system', 'developer', 'user', 'assistant', 'tool'."),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id",
     "missing_required_parameter", "'messages[0].tool_call_id'"),
    ({"messages": [{"role": "tool", "content": None, "tool_call_id": "t"}]}, 400, "messages[0].content",
     "missing_required_parameter", "'messages[0].content'"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages[0].tool_calls",
     "invalid_value", "only allowed on messages with role 'assistant'"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                         "function": {"name": "f",
                                                                                      "arguments": {}}}]}]},
     400, "messages[0].tool_calls[0].function.arguments", "invalid_type", "expected a string, but got an object"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "missing_required_parameter", "content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type", "got an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", "unsupported_value", "does not support 'image_url'"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 400,
     "messages[0].tool_calls[0].type", "missing_required_parameter", "'messages[0].tool_calls[0].type'"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]}, 400, "messages[0].tool_calls[0].id", "missing_required_parameter",
     "'messages[0].tool_calls[0].id'"),
])
def test_chat_validation_errors(body: dict, status: int, param: str | None, code: str | None,
                                fragment: str) -> None:
    exc = error_of(chat, **body)
    assert (exc.status, exc.param, exc.code, exc.type) == (status, param, code, "invalid_request_error")
    assert fragment in exc.message


@pytest.mark.parametrize("body, status, param, code, fragment", [
    ({"logprobs": 6}, 400, "logprobs", "integer_above_max_value", "<= 5"),
    ({"logprobs": True}, 400, "logprobs", "invalid_type", "expected an integer, but got a boolean"),
    ({"max_tokens": 0}, 400, "max_tokens", "integer_below_min_value", "Expected a value >= 1, but got 0"),
    ({"prompt_logprobs": 21}, 400, "prompt_logprobs", "integer_above_max_value", "<= 20"),
    ({"echo": 1}, 400, "echo", "invalid_type", "expected a boolean"),
    ({"suffix": "x"}, 400, "suffix", "unsupported_parameter", "'suffix' is not supported"),
    ({"best_of": 3}, 400, "best_of", "unsupported_parameter", "'best_of' is not supported"),
    ({"prompt": ["a", 1]}, 400, "prompt[0]", "invalid_type", "expected an integer, but got a string"),
    ({"prompt": [[1], []]}, 400, "prompt[1]", "empty_array", "empty array"),
    ({"prompt": [[1], [-1]]}, 400, "prompt[1][0]", "invalid_value", "not a valid token id"),
    ({"prompt": ["a"] * 2049}, 400, "prompt", "array_above_max_length", "maximum length 2048"),
    ({"prompt": []}, 400, "prompt", "empty_array", "empty array"),
    ({"prompt": [[]]}, 400, "prompt[0]", "empty_array", "empty array"),
    ({"prompt": [1, "a"]}, 400, "prompt[1]", "invalid_type", "expected an integer, but got a string"),
    ({"prompt": 5}, 400, "prompt", "invalid_type", "expected a string or an array"),
    ({"prompt": None}, 400, "prompt", "missing_required_parameter", "Missing required parameter: 'prompt'."),
    ({"messages": USER}, 400, None, None, "Unrecognized request argument supplied: messages"),
    ({"max_completion_tokens": 5}, 400, None, None, "Unrecognized request argument supplied: max_completion_tokens"),
])
def test_completion_validation_errors(body: dict, status: int, param: str | None, code: str | None,
                                      fragment: str) -> None:
    exc = error_of(completion, **body)
    assert (exc.status, exc.param, exc.code) == (status, param, code)
    assert fragment in exc.message


def test_body_must_be_an_object() -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request([1], request_id="x", model_ids=[MODEL], default_max_tokens=1)
    assert (info.value.status, info.value.message) == (400, "Invalid request body: expected a JSON object.")


def test_malformed_json() -> None:
    with pytest.raises(ApiError) as info:
        parse_json_body(b'{"model": ')
    assert (info.value.status, info.value.code) == (400, "invalid_json")
    assert info.value.message.startswith("We could not parse the JSON body of your request")
    assert parse_json_body(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}


def test_error_body_shape() -> None:
    exc = ApiError(404, "nope", code="model_not_found")
    assert exc.body() == {"error": {"message": "nope", "type": "invalid_request_error", "param": None,
                                    "code": "model_not_found"}}


# --- responses ---

def chunk(index: int, text: str, token_ids: list[int], finish: str | None = None, logprobs=None,
          texts: list[str] | None = None) -> GenerateChunk:
    return GenerateChunk("r1", index, text, token_ids, logprobs=logprobs, token_texts=texts, finish_reason=finish,
                         num_prompt_tokens=5, num_cached_tokens=4)


def two_sample_output() -> RequestOutput:
    output = RequestOutput(2)
    for c in (chunk(0, "Hel", [1]), chunk(1, "Yo", [7], "stop"), chunk(0, "lo", [2], "length")):
        assert output.add(c)
    return output


def test_request_output_accumulates_and_rejects_bad_chunks() -> None:
    output = two_sample_output()
    assert output.is_finished
    assert not output.add(chunk(0, "x", [9]))  # sample already finished
    assert not output.add(chunk(2, "x", [9]))  # no such sample
    assert [s.text for s in output.samples] == ["Hello", "Yo"]
    assert output.usage() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 4}}


def test_chat_response_body() -> None:
    assert chat_response("r1", MODEL, 100, two_sample_output(), has_logprobs=False) == {
        "id": "r1", "object": "chat.completion", "created": 100, "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello", "refusal": None}, "logprobs": None,
             "finish_reason": "length"},
            {"index": 1, "message": {"role": "assistant", "content": "Yo", "refusal": None}, "logprobs": None,
             "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 4}}}


LOGPROBS = [TokenLogprobEntry(1, -0.5, [(1, -0.5), (8, -1.5)]), TokenLogprobEntry(2, -0.25, [(2, -0.25)])]


def test_chat_response_logprobs() -> None:
    output = RequestOutput(1)
    output.add(chunk(0, "Hé", [1, 2], "stop", LOGPROBS, ["H", "é"]))
    body = chat_response("r1", MODEL, 100, output, has_logprobs=True)
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "H", "logprob": -0.5, "bytes": [72],
         "top_logprobs": [{"token": "H", "logprob": -0.5, "bytes": [72]},
                          {"token": "token_id:8", "logprob": -1.5, "bytes": list(b"token_id:8")}]},
        {"token": "é", "logprob": -0.25, "bytes": [195, 169],
         "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]}]}], "refusal": None}


def test_completion_response_body_with_logprobs() -> None:
    output = RequestOutput(1)
    output.add(chunk(0, "Hé", [1, 2], "stop", LOGPROBS, ["H", "é"]))
    assert completion_response("r1", MODEL, 100, output, has_logprobs=True) == {
        "id": "r1", "object": "text_completion", "created": 100, "model": MODEL,
        "choices": [{"index": 0, "text": "Hé", "finish_reason": "stop",
                     "logprobs": {"tokens": ["H", "é"], "token_logprobs": [-0.5, -0.25],
                                  "top_logprobs": [{"H": -0.5, "token_id:8": -1.5}, {"é": -0.25}],
                                  "text_offset": [0, 1]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 4}}}


def test_chat_stream_chunks() -> None:
    assert chat_role_chunk("r1", MODEL, 100, 1, include_usage=True) == {
        "id": "r1", "object": "chat.completion.chunk", "created": 100, "model": MODEL,
        "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}], "usage": None}
    assert chat_chunk("r1", MODEL, 100, chunk(0, "Hi", [1]), has_logprobs=False, include_usage=False) == {
        "id": "r1", "object": "chat.completion.chunk", "created": 100, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]}
    last = chat_chunk("r1", MODEL, 100, chunk(0, "", [], "stop"), has_logprobs=True, include_usage=False)
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": {"content": [], "refusal": None},
                                "finish_reason": "stop"}]


def test_completion_stream_chunk_offsets_continue() -> None:
    body = completion_chunk("r1", MODEL, 100, chunk(0, "Hé", [1, 2], None, LOGPROBS, ["H", "é"]),
                            has_logprobs=True, text_offset=10, include_usage=False)
    assert body == {"id": "r1", "object": "text_completion", "created": 100, "model": MODEL,
                    "choices": [{"index": 0, "text": "Hé", "finish_reason": None,
                                 "logprobs": {"tokens": ["H", "é"], "token_logprobs": [-0.5, -0.25],
                                              "top_logprobs": [{"H": -0.5, "token_id:8": -1.5}, {"é": -0.25}],
                                              "text_offset": [10, 11]}}]}


def test_usage_chunk() -> None:
    assert usage_chunk("r1", "text_completion", MODEL, 100, two_sample_output()) == {
        "id": "r1", "object": "text_completion", "created": 100, "model": MODEL, "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 4}}}


def test_chat_without_max_tokens_sends_a_default_the_worker_may_clip() -> None:
    assert chat().generate.sampling.is_max_tokens_default is True
    assert chat().generate.sampling.max_tokens == 1024
    assert chat(max_tokens=5).generate.sampling.is_max_tokens_default is False
    assert chat(max_completion_tokens=5).generate.sampling.is_max_tokens_default is False
    assert completion().generate.sampling.is_max_tokens_default is False
    assert error_of(chat, is_max_tokens_default=True).status == 400  # internal: not a body parameter


# --- batched prompts: one output, choices p * n + i, usage summed over prompts ---

def test_batch_output_indexes_choices_and_sums_usage() -> None:
    output = RequestOutput(2, num_prompts=2)  # choices 0, 1: prompt 0; 2, 3: prompt 1
    output.echo(0, "A")
    output.echo(1, "B")
    for index, (text, num_prompt, num_cached) in enumerate([("a0", 3, 1), ("a1", 3, 1), ("b0", 5, 0), ("b1", 5, 0)]):
        assert output.add(GenerateChunk("r", index, text, [index], finish_reason="stop",
                                        num_prompt_tokens=num_prompt, num_cached_tokens=num_cached))
        assert output.is_prompt_finished(index // 2) == (index % 2 == 1)
    assert [s.text for s in output.samples] == ["Aa0", "Aa1", "Bb0", "Bb1"]
    assert output.echoes == ["A", "A", "B", "B"]
    assert output.usage() == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    assert not output.add(GenerateChunk("r", 4, "x", [9]))
    assert completion_response("r", MODEL, 1, output, False)["choices"][3] == {
        "index": 3, "text": "Bb1", "logprobs": None, "finish_reason": "stop"}


# --- /tokenize and /detokenize (vLLM's shapes) ---

def test_tokenize_bodies() -> None:
    assert parse_tokenize_request({"model": MODEL, "prompt": "hi"}, request_id="t") == TokenizeRequest(
        "t", prompt_text="hi", add_special_tokens=True)
    assert parse_tokenize_request({"prompt": "", "add_special_tokens": False}, request_id="t") == TokenizeRequest(
        "t", prompt_text="", add_special_tokens=False)
    assert parse_tokenize_request({"messages": USER, "add_generation_prompt": True}, request_id="t") == \
        TokenizeRequest("t", messages=[ChatMessage("user", "hi")], add_special_tokens=False)
    assert parse_detokenize_request({"model": MODEL, "tokens": [1, 2]}, request_id="d") == DetokenizeRequest(
        "d", [1, 2])


@pytest.mark.parametrize("parse, body, param, code, fragment", [
    (parse_tokenize_request, {}, "prompt", "invalid_value", "Exactly one of 'prompt' and 'messages'"),
    (parse_tokenize_request, {"prompt": "a", "messages": USER}, "prompt", "invalid_value", "Exactly one"),
    (parse_tokenize_request, {"prompt": [1]}, "prompt", "invalid_type", "expected a string"),
    (parse_tokenize_request, {"prompt": "a", "x": 1}, None, None, "Unrecognized request argument supplied: x"),
    (parse_tokenize_request, {"messages": USER, "add_special_tokens": True}, "add_special_tokens",
     "unsupported_value", "must be false with 'messages'"),
    (parse_tokenize_request, {"messages": USER, "add_generation_prompt": False}, "add_generation_prompt",
     "unsupported_value", "must be true with 'messages'"),
    (parse_tokenize_request, {"messages": []}, "messages", "empty_array", "empty array"),
    (parse_tokenize_request, [], None, "invalid_type", "expected a JSON object"),
    (parse_detokenize_request, {}, "tokens", "missing_required_parameter", "'tokens'"),
    (parse_detokenize_request, {"tokens": "abc"}, "tokens", "invalid_type", ""),
    (parse_detokenize_request, {"tokens": [1, -2]}, "tokens[1]", "invalid_value", "not a valid token id"),
])
def test_tokenize_errors(parse, body: Any, param: str | None, code: str | None, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body, request_id="t")
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    assert fragment in info.value.message


# --- prompt logprobs ---

def test_echo_with_logprobs_asks_for_the_prompts_logprobs() -> None:
    parsed = completion(echo=True, logprobs=2, max_tokens=0)
    assert parsed.generate.sampling == SamplingSpec(max_tokens=0, logprobs=2, prompt_logprobs=2)
    assert (parsed.is_echo, parsed.has_prompt_logprobs) == (True, False)
    assert completion(echo=True, logprobs=1, prompt_logprobs=4).generate.sampling.prompt_logprobs == 4
    assert completion(echo=True, max_tokens=0).generate.sampling.prompt_logprobs is None  # echo alone: the text


def test_prompt_logprobs_is_vllms_field_on_both_endpoints() -> None:
    parsed = completion(prompt_logprobs=0, max_tokens=0)
    assert (parsed.generate.sampling.prompt_logprobs, parsed.generate.sampling.max_tokens) == (0, 0)
    assert parsed.has_prompt_logprobs is True
    assert chat(prompt_logprobs=3).generate.sampling.prompt_logprobs == 3
    assert chat(prompt_logprobs=3).has_prompt_logprobs is True
    assert error_of(chat, prompt_logprobs=3, max_tokens=0).param == "max_tokens"  # chat always generates
    assert error_of(chat, max_completion_tokens=0).param == "max_completion_tokens"
