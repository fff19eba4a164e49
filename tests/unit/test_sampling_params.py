"""SamplingParams (shared/sampling.py): one class for gateway, wire and engine; its bounds; its wire form."""
from __future__ import annotations

import msgspec
import pytest

from services.gateway import protocol
from services.gpu_worker import request, sampler
from shared import messages
from shared.sampling import SamplingError, SamplingParams, check_value, sampling_params


def test_gateway_wire_and_engine_use_the_same_class() -> None:
    parsed = protocol.parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                         request_id="r", model_ids=["m"], default_max_tokens=8)

    assert type(parsed.generate.sampling) is SamplingParams
    for message in (messages.GenerateRequest, messages.TokenizedRequest):
        assert {f.name: f.type for f in msgspec.structs.fields(message)}["sampling"] is SamplingParams
    assert messages.SamplingSpec is request.SamplingParams is sampler.SamplingParams is SamplingParams


def test_the_wire_form_keeps_its_field_names_and_defaults() -> None:
    old_sender = {"max_tokens": 5, "temperature": 0.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": None,
                  "stop_token_ids": [7], "ignore_eos": False, "n": 1, "logprobs": None}

    params = msgspec.msgpack.decode(msgspec.msgpack.encode(old_sender), type=SamplingParams)

    assert params == SamplingParams(max_tokens=5, temperature=0.5, stop_token_ids=(7,))
    additive = {"logit_bias": [], "is_max_tokens_default": False, "prompt_logprobs": None, "output_constraint": None,
                "speculative": True}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params)) == {**old_sender, **additive}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({}), type=SamplingParams) == SamplingParams()


def test_logit_bias_crosses_the_wire_as_pairs() -> None:
    params = SamplingParams(logit_bias=((3, -100.0), (9, 2.5)))

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert params.check() is params


@pytest.mark.parametrize("fields, param, code, message", [
    ({"top_p": 0.0}, "top_p", "decimal_below_min_value",
     "Invalid 'top_p': decimal below minimum value. Expected a value > 0, but got 0.0 instead."),
    ({"max_tokens": -1}, "max_tokens", "integer_below_min_value",
     "Invalid 'max_tokens': integer below minimum value. Expected a value >= 0, but got -1 instead."),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "integer_above_max_value",
     "Invalid 'prompt_logprobs': integer above maximum value. Expected a value <= 20, but got 21 instead."),
    ({"temperature": 2.5}, "temperature", "decimal_above_max_value",
     "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5 instead."),
    ({"n": 17}, "n", "integer_above_max_value",
     "Invalid 'n': integer above maximum value. Expected a value <= 16, but got 17 instead."),
    ({"logprobs": 21}, "logprobs", "integer_above_max_value",
     "Invalid 'logprobs': integer above maximum value. Expected a value <= 20, but got 21 instead."),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "decimal_below_min_value",
     "Invalid 'repetition_penalty': decimal below minimum value. Expected a value > 0, but got 0.0 instead."),
    ({"stop_token_ids": (1, -1)}, "stop_token_ids[1]", "invalid_value",
     "Invalid 'stop_token_ids[1]': -1 is not a valid token id."),
    ({"ignore_eos": 1}, "ignore_eos", "invalid_type",
     "Invalid type for 'ignore_eos': expected a boolean, but got an integer instead."),
    ({"logit_bias": ((5, 100.5),)}, "logit_bias.5", "decimal_above_max_value",
     "Invalid 'logit_bias.5': decimal above maximum value. Expected a value <= 100, but got 100.5 instead."),
])
def test_check_names_the_first_field_out_of_its_bounds(fields: dict, param: str, code: str, message: str) -> None:
    with pytest.raises(SamplingError) as info:
        SamplingParams(**fields).check()

    assert (info.value.param, info.value.code, info.value.message, str(info.value)) == (param, code, message, message)


def test_valid_params_pass_the_check_unchanged() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=-1, seed=-3, stop_token_ids=(1, 2),
                            n=16, logprobs=0)

    assert params.check() is params
    assert params.is_greedy and not SamplingParams().is_greedy


def test_values_from_json_are_normalized_to_the_field_types() -> None:
    params = sampling_params({"temperature": 1, "stop_token_ids": [3, 4], "seed": 2**63 - 1})

    assert (params.temperature, params.stop_token_ids, params.seed) == (1.0, (3, 4), 2**63 - 1)
    assert type(params.temperature) is float
    assert check_value("max_tokens", 3, param="max_completion_tokens") == 3
    with pytest.raises(SamplingError, match="'max_completion_tokens'") as info:
        check_value("max_tokens", -1, param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
