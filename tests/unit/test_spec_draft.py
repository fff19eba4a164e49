"""The draft-model proposer (spec/draft.py) in the engine, on tiny random models, in both step modes: greedy output
identical to plain decoding with the target itself as the draft (every draft accepted) and with another model of
the same vocabulary (few accepted); the draft engine's prefix cache serves each proposal's verified prefix; the
proposals it cannot make. Its start-up checks: test_spec_config.py."""
from __future__ import annotations

import pytest

from services.gpu_worker.spec.draft import DraftProposer
from services.gpu_worker.spec.proposer import ProposalRequest
from tests.unit.step_modes import step_mode  # noqa: F401 - step_mode: autouse, both modes
from tests.unit.test_spec_engine import _assert_idle, _assert_same, _engine, _outputs, _plain, _prompts


def _draft_engine(draft_model: str, **overrides: object):
    return _engine(speculative_method="draft", speculative_draft_model=draft_model, **overrides)


def test_the_target_as_its_own_draft_gives_plain_greedy_output_and_every_draft_is_accepted() -> None:
    engine = _draft_engine("random:tiny-llama", seed=1)  # the target's weights: random:tiny-llama, seed 1
    _assert_same(_outputs(engine, _prompts()), _plain("greedy"))
    metrics = engine.metrics
    assert metrics.num_spec_draft_tokens > 0
    assert metrics.num_spec_accepted_tokens == metrics.num_spec_draft_tokens
    assert engine.stats().num_steps == 1 + 5  # the prefill's token, then k + 1 = 5 tokens per verify step
    _assert_idle(engine)
    draft = engine.speculator.proposer.engine
    _assert_idle(draft)
    # after its first proposal for a sequence, the draft engine finds the verified prefix in its cache
    assert draft.metrics.num_prefix_hits > draft.metrics.num_prompt_tokens // 2


@pytest.mark.parametrize("draft_model", ["random:tiny-llama", "random:tiny-qwen2"])  # seed 0: not the target
def test_another_draft_model_of_the_same_vocabulary_gives_plain_greedy_output(draft_model: str) -> None:
    engine = _draft_engine(draft_model)
    _assert_same(_outputs(engine, _prompts()), _plain("greedy"))
    metrics = engine.metrics
    assert metrics.num_spec_draft_tokens > 0
    assert metrics.num_spec_accepted_tokens < metrics.num_spec_draft_tokens // 4
    _assert_idle(engine)


def test_a_proposal_the_draft_model_cannot_hold_gets_no_drafts() -> None:
    engine = _draft_engine("random:tiny-llama", num_pages=8)  # 7 pages of 4 tokens: sequences of < 28 tokens
    proposer: DraftProposer = engine.speculator.proposer
    requests = [ProposalRequest([5, 6, 7], 3), ProposalRequest([5] * 28, 3), ProposalRequest([5, 6], 0),
                ProposalRequest([9, 8, 7, 6], 2)]
    drafts = proposer.propose(requests)
    assert [len(d) for d in drafts] == [3, 0, 0, 2]
    assert proposer.num_requests == 2
    assert all(0 <= t < 512 for d in drafts for t in d)
