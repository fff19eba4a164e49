"""Structured output in the engine, on a tiny random model that speaks the bundled SmolLM2 tokenizer (49,152 tokens):
constrained rows follow their grammar in both step modes, beside unconstrained rows they leave alone, under sampling,
n > 1, logprobs, preemption, chunked prefill and the prefix cache; the bitmask's bit order."""
from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model, random_state_dict
from services.gpu_worker.request import FinishReason, SamplingParams
from services.gpu_worker.structured_output import StructuredOutput
from services.tokenizer.model_files import load_bundled_tokenizer
from shared.output_constraint import ConstraintKind, OutputConstraint
from tests.unit.step_modes import MODE, step_mode  # noqa: F401 - step_mode: autouse, both modes

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
JSON_SCHEMA = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
CHOICE = OutputConstraint(ConstraintKind.CHOICE, json.dumps(["yes", "no", "maybe so"]))
REGEX = OutputConstraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2,4}")
PROMPTS = [[5, 6, 7, 8 + i] for i in range(6)]


@functools.cache
def _loaded() -> LoadedModel:
    tokenizer = load_bundled_tokenizer()
    tiny = load_model("random:tiny-llama", dtype=torch.float32, seed=1).config
    config = tiny.with_(vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,))
    return LoadedModel(config, random_state_dict(config, torch.float32, "cpu", 1), tokenizer, None)


def _engine(**overrides: object) -> Engine:
    settings = dict(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=512, page_size=4,
                    enable_overlap=MODE["overlap"])
    return Engine(EngineConfig(**{**settings, **overrides}), loaded=_loaded())


def _params(constraint: OutputConstraint | None, seed: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=60, temperature=1.0, seed=seed, output_constraint=constraint, **kw)


def _text(token_ids: list[int]) -> str:
    return _loaded().tokenizer.decode(token_ids, skip_special_tokens=True)


def _check(constraint: OutputConstraint, text: str) -> None:
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif constraint.kind is ConstraintKind.CHOICE:
        assert text in json.loads(constraint.spec)
    else:
        assert re.fullmatch(constraint.spec, text), text


def test_constrained_rows_match_their_grammar_and_end_with_it() -> None:
    engine = _engine()
    constraints = [JSON_SCHEMA, CHOICE, REGEX, JSON_SCHEMA, CHOICE, REGEX]

    results = engine.generate(PROMPTS, [_params(c, seed) for seed, c in enumerate(constraints)])

    for constraint, result in zip(constraints, results):
        sample = result.samples[0]
        assert sample.finish_reason is FinishReason.STOP
        _check(constraint, _text(sample.token_ids))
    free = engine.generate(PROMPTS[:1], _params(None, 0))[0].samples[0]
    assert free.finish_reason is FinishReason.LENGTH  # without the grammar the random model rambles


def test_unconstrained_rows_beside_constrained_ones_are_untouched() -> None:
    alone = _engine().generate(PROMPTS[:3], [_params(None, seed) for seed in range(3)])
    mixed = _engine().generate(PROMPTS[:3] + PROMPTS[3:], [_params(None, seed) for seed in range(3)]
                               + [_params(JSON_SCHEMA, seed) for seed in range(3)])

    assert [r.samples[0].token_ids for r in mixed[:3]] == [r.samples[0].token_ids for r in alone]


def test_greedy_n_logprobs_and_the_prefix_cache() -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=60, temperature=0.0, n=2, logprobs=3, output_constraint=JSON_SCHEMA)

    first, again = (engine.generate([list(range(10, 30))], params)[0] for _ in range(2))

    assert again.num_cached_tokens > 0
    for sample in first.samples + again.samples:
        _check(JSON_SCHEMA, _text(sample.token_ids))
        assert all(lp.logprob > -float("inf") for lp in sample.logprobs)
        assert len(sample.logprobs) == len(sample.token_ids)
    assert first.samples[0].token_ids == first.samples[1].token_ids == again.samples[0].token_ids


def test_preemption_and_chunked_prefill_keep_the_grammar() -> None:
    engine = _engine(num_pages=40, max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompts = [list(range(100 + 13 * i, 100 + 13 * i + 30)) for i in range(6)]

    results = engine.generate(prompts, [_params(JSON_SCHEMA, seed) for seed in range(6)])

    assert engine.stats().num_preemptions > 0
    for result in results:
        assert result.samples[0].finish_reason is FinishReason.STOP
        _check(JSON_SCHEMA, _text(result.samples[0].token_ids))


def test_a_bad_grammar_or_no_tokenizer_is_refused_at_admission() -> None:
    with pytest.raises(ValueError, match="regex"):
        _engine().add_request("r", [1, 2], _params(OutputConstraint(ConstraintKind.REGEX, "a(b"), 0))
    loaded = _loaded()
    bare = Engine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=64, page_size=4),
                  loaded=LoadedModel(loaded.config, loaded.state_dict, None, None))
    with pytest.raises(ValueError, match="tokenizer"):
        bare.add_request("r", [1, 2], _params(CHOICE, 0))


def test_the_bitmask_allows_exactly_its_bits() -> None:
    structured = StructuredOutput(None, vocab_size=70, eos_token_ids=[0], device=torch.device("cpu"))
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, structured.num_words, dtype=torch.int32)  # [2, 3]: 96 bits for 70 tokens
    bitmask[0, 0] = 1 - (1 << 31)  # tokens 0 and 31 (bit 31 is int32's sign)
    bitmask[1, 2] = 1 << 5  # token 69

    masked = structured.apply(logits, bitmask, rows=[0, 2])

    assert masked[0].isfinite().nonzero().flatten().tolist() == [0, 31]
    assert masked[1].isfinite().all()
    assert masked[2].isfinite().nonzero().flatten().tolist() == [69]


def test_top_logprobs_leave_out_what_the_grammar_rules_out() -> None:
    """Where the grammar allows fewer tokens than the alternatives asked for, the rest had logprob -inf: they are left
    out (JSON has no -inf; an encoder writes null where clients expect a number)."""
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=5, output_constraint=CHOICE)

    sample = _engine().generate(PROMPTS[:1], params)[0].samples[0]

    tops = [lp.top for lp in sample.logprobs]
    assert all(val > -float("inf") for top in tops for _, val in top)
    assert any(len(top) < 5 for top in tops)  # a forced step ("yes" / "no" / "maybe so" share few prefixes)
    assert all(any(tid == lp.token_id for tid, _ in lp.top) for lp in sample.logprobs)  # the chosen one kept
