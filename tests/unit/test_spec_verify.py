"""Unit tests for speculative verification (spec/verify.py): greedy exactness against the sampler, rejection
sampling's output distribution (with wrong rules shown to fail the same check), seeded reproducibility."""
from __future__ import annotations

import math

import pytest
import torch

import services.gpu_worker.spec.verify as verify_module
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.sampler import Sampler, SamplingRow, make_generator
from services.gpu_worker.spec.verify import SpecRow, verify

P = [0.5, 0.3, 0.15, 0.05]  # the target distribution of the statistical tests
Q = [0.1, 0.2, 0.3, 0.4]  # the proposer's, far from P
TRIALS = 20_000
# Hoeffding and a union bound over the V tokens: P(any |freq - p| > BOUND) <= 2 V exp(-2 N BOUND^2) = 1e-6
BOUND = math.sqrt(math.log(2 * len(P) / 1e-6) / (2 * TRIALS))  # about 0.02


def spec_row(proposal, output=(), gen=None, draft_probs=None, **kw) -> SpecRow:
    return SpecRow(SamplingRow(SamplingParams(**kw), [0], list(output), gen), list(proposal), draft_probs)


def test_greedy_accepts_all_matching_drafts_and_appends_the_bonus_argmax() -> None:
    logits = torch.randn(1, 4, 16)  # [B, K+1, V]
    best = logits[0].argmax(-1).tolist()
    [out] = verify(logits, [spec_row(best[:3], temperature=0.0)])
    assert out.num_accepted == 3 and out.token_ids == best


def test_greedy_stops_at_the_first_mismatch_with_the_targets_argmax() -> None:
    logits = torch.randn(2, 4, 16)
    best = logits.argmax(-1).tolist()  # [B][K+1]
    wrong = (best[0][1] + 1) % 16
    rows = [spec_row([best[0][0], wrong, best[0][2]], temperature=0.0),
            spec_row([(best[1][0] + 1) % 16], temperature=0.0)]  # k = 1 in a batch padded to 3
    first, second = verify(logits, rows)
    assert (first.num_accepted, first.token_ids) == (1, [best[0][0], best[0][1]])
    assert (second.num_accepted, second.token_ids) == (0, [best[1][0]])


def test_zero_drafts_is_plain_sampling_with_the_samplers_tokens_and_logprobs() -> None:
    logits = torch.randn(3, 1, 16)
    params = [dict(temperature=0.0, logprobs=3), dict(temperature=0.0, repetition_penalty=1.5, logit_bias=((2, 1.0),)),
              dict(temperature=0.0)]
    outs = verify(logits, [spec_row([], output=[1, 2], **p) for p in params])
    tokens, logprobs = Sampler()(logits[:, 0], [SamplingRow(SamplingParams(**p), [0], [1, 2], None) for p in params])
    assert [o.token_ids for o in outs] == [[t] for t in tokens]
    assert outs[0].logprobs == [logprobs[0]] and outs[1].logprobs is None


def test_greedy_with_penalties_sees_the_drafts_before_each_position() -> None:
    """The sampler run step by step (history growing by its own tokens) gives the drafts: all must be accepted."""
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 8)
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=1.0)
    output: list[int] = []
    for j in range(5):
        tokens, _ = Sampler()(logits[:, j], [SamplingRow(params, [0], list(output), None)])
        output += tokens
    [out] = verify(logits, [SpecRow(SamplingRow(params, [0], [], None), output[:4])])
    assert out.num_accepted == 4 and out.token_ids == output


def test_logprobs_are_the_raw_logits_log_softmax_of_each_appended_token() -> None:
    logits = torch.randn(1, 3, 8)
    best = logits[0].argmax(-1).tolist()
    [out] = verify(logits, [spec_row(best[:2], temperature=0.0, logprobs=2)])
    raw = logits[0].log_softmax(-1)
    assert [lp.token_id for lp in out.logprobs] == best
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([raw[j, t].item() for j, t in enumerate(best)])
    assert [len(lp.top) for lp in out.logprobs] == [2, 2, 2]


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError):
        verify(torch.randn(1, 2, 8), [spec_row([1, 2], temperature=0.0)])  # 2 drafts need 3 positions
    with pytest.raises(ValueError):
        verify(torch.randn(2, 2, 8), [spec_row([1], temperature=0.0)])


def first_tokens(case: str) -> tuple[list[int], list[float]]:
    """TRIALS rows of one case; returns each row's first emitted token and the distribution it must follow."""
    torch.manual_seed(1234)
    p, q = torch.tensor(P), torch.tensor(Q)
    logits = p.log().expand(TRIALS, 3, len(P))  # [B, K+1, V]: p at every position
    if case == "draft distribution":  # a draft model's proposals: x ~ q, with q given
        drafts = torch.multinomial(q, TRIALS * 2, replacement=True).view(TRIALS, 2).tolist()
        rows = [spec_row(x, temperature=1.0, draft_probs=q.expand(2, -1)) for x in drafts]
        expected = P
    elif case == "one-hot":  # n-gram: the same deterministic proposal every time
        rows = [spec_row([0, 1], temperature=1.0) for _ in range(TRIALS)]
        expected = P
    else:  # temperature 0.5 and top-k 2: p^2 on the two best tokens; the proposed token 3 is filtered out
        rows = [spec_row([3, 0], temperature=0.5, top_k=2) for _ in range(TRIALS)]
        expected = [P[0] ** 2 / (P[0] ** 2 + P[1] ** 2), P[1] ** 2 / (P[0] ** 2 + P[1] ** 2), 0.0, 0.0]
    return [out.token_ids[0] for out in verify(logits, rows)], expected


def max_deviation(tokens: list[int], expected: list[float]) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).float() / len(tokens)
    return (counts - torch.tensor(expected)).abs().max().item()


CASES = ["draft distribution", "one-hot", "temperature and top-k"]


@pytest.mark.parametrize("case", CASES)
def test_the_first_emitted_token_follows_the_target_distribution(case: str) -> None:
    tokens, expected = first_tokens(case)
    assert max_deviation(tokens, expected) < BOUND  # fails by chance with probability <= 1e-6


@pytest.mark.parametrize("case", CASES[:2])
@pytest.mark.parametrize("wrong", ["accept always", "no residual"])
def test_the_same_check_fails_with_a_wrong_acceptance_rule(case: str, wrong: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting every draft gives q (or the one-hot); resampling from p instead of the residual over-weights the
    drafts: both are at least 0.15 off in some token, far beyond BOUND, so the statistical check can fail."""
    if wrong == "accept always":
        monkeypatch.setattr(verify_module, "_accept", lambda p_x, q_x, u: torch.ones_like(u, dtype=torch.bool))
    else:
        monkeypatch.setattr(verify_module, "_residual", lambda p, q: p)
    tokens, expected = first_tokens(case)
    assert max_deviation(tokens, expected) > 5 * BOUND


def test_rejected_drafts_are_corrected_to_tokens_the_filters_allow() -> None:
    tokens, _ = first_tokens("temperature and top-k")
    assert set(tokens) <= {0, 1}


def seeded_batch(seed: int, with_neighbour: bool) -> list[list[int]]:
    logits = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(7))
    rows = [spec_row([1, 2], gen=make_generator(seed, 0, "cpu"), temperature=0.9, top_p=0.9)]
    if with_neighbour:  # pads the batch to 4 drafts and draws from the global RNG in between
        rows.append(spec_row([3, 3, 3, 3], temperature=1.0))
    return [out.token_ids for out in verify(logits[:len(rows)], rows)]


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch() -> None:
    runs = [seeded_batch(seed, False)[0] for seed in range(40)]
    assert runs == [seeded_batch(seed, True)[0] for seed in range(40)]
    assert runs == [seeded_batch(seed, False)[0] for seed in range(40)]
    assert len({tuple(r) for r in runs}) > 1  # the seed matters


def test_a_mixed_batch_keeps_each_rows_rule() -> None:
    """Greedy, draft-distribution and one-hot rows with different k in one batch; the target is nearly certain
    (token 2 at every position), so the outcome is known: drafts of 2 are kept, the first other draft is replaced."""
    logits = torch.full((3, 4, 5), -30.0)
    logits[:, :, 2] = 0.0  # [B, K+1, V]
    q = torch.full((2, 5), 0.2)
    rows = [spec_row([2, 2, 1], temperature=0.0), spec_row([2, 4], temperature=1.0, draft_probs=q),
            spec_row([], temperature=1.0)]
    outs = verify(logits, rows)
    assert [(o.num_accepted, o.token_ids) for o in outs] == [(2, [2, 2, 2]), (1, [2, 2]), (0, [2])]
