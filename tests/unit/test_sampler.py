"""Unit tests for the batched sampler: exact filters, penalties, logprobs, seeding and HF parity."""
from __future__ import annotations

import math

import pytest
import torch

from services.gpu_worker.request import SamplingParams
from services.gpu_worker.sampler import Sampler, SamplingRow, apply_filters, apply_penalties, make_generator


def row(gen: torch.Generator | None = None, prompt=(), output=(), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen)


def seeded_rows(n: int, seed: int = 0, **kw) -> list[SamplingRow]:
    return [row(make_generator(seed, i, "cpu"), **kw) for i in range(n)]


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()  # [V]


def drawn(logits_1d: torch.Tensor, n: int = 500, **kw) -> set[int]:
    tokens, _ = Sampler()(logits_1d.expand(n, -1), seeded_rows(n, **kw))
    return set(tokens)


def test_logit_bias_plus_100_makes_greedy_pick_the_token_and_minus_100_bans_it() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -3.0]] * 3)  # [B, V]
    rows = [row(temperature=0.0, logit_bias=((3, 100.0),)), row(temperature=0.0, logit_bias=((0, -100.0),)),
            row(temperature=0.0, logit_bias=((9, 100.0),))]  # id 9 is outside the vocabulary: ignored
    tokens, _ = Sampler()(logits, rows)
    assert tokens == [3, 1, 0]


def test_logit_bias_overrides_a_precomputed_greedy_argmax() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])  # [B, V]
    sample = Sampler().launch(logits, [row(temperature=0.0, logit_bias=((2, 10.0),))], greedy=logits.argmax(-1))
    assert sample.resolve()[0] == [2]


def test_logit_bias_minus_100_bans_a_token_when_sampling() -> None:
    assert drawn(torch.zeros(4), logit_bias=((1, -100.0),)) == {0, 2, 3}
    assert drawn(torch.zeros(4), temperature=2.0, logit_bias=((2, 100.0),)) == {2}


def test_greedy_argmax_and_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3  # [B, V]
    tokens, lps = Sampler()(logits, [row(temperature=0.0, logprobs=5) for _ in range(4)])
    assert tokens == logits.argmax(dim=-1).tolist()
    ref = torch.log_softmax(logits.double(), dim=-1)
    for b, lp in enumerate(lps):
        assert lp is not None and lp.token_id == tokens[b]
        assert abs(lp.logprob - ref[b, tokens[b]].item()) < 1e-6
        top_vals, top_ids = ref[b].topk(5)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert all(abs(v - r) < 1e-6 for (_, v), r in zip(lp.top, top_vals.tolist()))
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    assert Sampler()(logits, [row(temperature=0.0)])[0] == [1]


def test_logprobs_none_and_zero() -> None:
    logits = torch.randn(2, 10)
    _, lps = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0, logprobs=0)])
    assert lps[0] is None
    assert lps[1] is not None and lps[1].top == []


def test_logprobs_are_from_raw_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    r = row(temperature=0.0, logprobs=2, repetition_penalty=4.0, prompt=[0], frequency_penalty=1.0, output=[0])
    tokens, lps = Sampler()(logits, [r])
    assert tokens == [1]  # penalties moved the argmax
    assert abs(lps[0].logprob - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-6
    assert [t for t, _ in lps[0].top] == [0, 1]


def test_top_k_exact_set() -> None:
    logits = log_probs([0.1, 0.35, 0.05, 0.3, 0.2])
    assert drawn(logits, top_k=2) == {1, 3}


def test_top_p_keeps_exactly_three() -> None:
    logits = log_probs([0.1, 0.4, 0.2, 0.3])
    assert drawn(logits, top_p=0.85) == {1, 2, 3}
    assert drawn(logits, top_p=0.01) == {1}


def test_min_p_threshold_exact() -> None:
    logits = log_probs([0.1, 0.5, 0.15, 0.25])
    assert drawn(logits, min_p=0.25) == {1, 2, 3}  # threshold 0.125
    assert drawn(logits, min_p=0.45) == {1, 3}  # threshold 0.225
    filtered = apply_filters(logits[None], [SamplingParams(min_p=0.45)])
    assert torch.isinf(filtered).tolist() == [[True, False, True, False]]


def test_near_zero_temperature_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 30)  # [B, V]
    for temp in (1e-3, 1e-7):
        tokens, _ = Sampler()(logits, seeded_rows(8, temperature=temp))
        assert tokens == logits.argmax(dim=-1).tolist()


def test_filters_compose_in_order() -> None:
    logits = log_probs([0.3, 0.25, 0.2, 0.15, 0.1])
    assert drawn(logits, top_p=0.6) == {0, 1, 2}
    assert drawn(logits, top_k=4, top_p=0.6) == {0, 1}  # top-p renormalizes within the top 4
    assert drawn(logits, top_k=2, min_p=0.5) == {0, 1}


def test_repetition_penalty_both_signs() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(logits, [row(prompt=[0, 1], output=[1, 4], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.25]]


def test_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    r = row(prompt=[3, 3], output=[0, 0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0 - 1.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0]]  # prompt tokens untouched


def test_penalties_per_row_and_input_untouched() -> None:
    logits = torch.tensor([[1.0, -1.0, 3.0], [1.0, -1.0, 3.0], [1.0, -1.0, 3.0]])
    before = logits.clone()
    rows = [
        row(prompt=[0], output=[1], repetition_penalty=2.0),
        row(prompt=[0], output=[1, 1]),
        row(prompt=[2], output=[2], frequency_penalty=1.0, repetition_penalty=3.0),
    ]
    out = apply_penalties(logits, rows)
    assert out.tolist() == [[0.5, -2.0, 3.0], [1.0, -1.0, 3.0], [1.0, -1.0, 0.0]]
    assert torch.equal(logits, before)


def run_steps(logits: torch.Tensor, make_rows, target: int, steps: int = 20) -> list[int]:
    sampler, rows, out = Sampler(), make_rows(), []
    for _ in range(steps):
        tokens, _ = sampler(logits, rows)
        out.append(tokens[target])
    return out


def test_seeded_rows_reproducible_across_batches() -> None:
    torch.manual_seed(0)
    vocab = 64
    own = torch.randn(vocab)  # [V]
    other = torch.randn(3, vocab)  # [3, V]
    kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    alone = run_steps(own[None], lambda: [row(make_generator(7, 0, "cpu"), **kw)], 0)

    def mixed() -> list[SamplingRow]:
        return [
            row(None, temperature=1.3, top_p=0.5),
            row(make_generator(99, 0, "cpu"), min_p=0.1, seed=99),
            row(make_generator(7, 0, "cpu"), **kw),
            row(temperature=0.0, frequency_penalty=0.5, output=[1, 2]),
        ]

    batch = torch.cat([other[:2], own[None], other[2:]])  # [4, V]
    assert run_steps(batch, mixed, 2) == alone
    moved = torch.cat([own[None], other])
    assert run_steps(moved, lambda: [mixed()[2]] + [mixed()[i] for i in (0, 1, 3)], 0) == alone
    index1 = run_steps(own[None], lambda: [row(make_generator(7, 1, "cpu"), **kw)], 0)
    assert index1 != alone


def test_make_generator() -> None:
    assert make_generator(None, 0, "cpu") is None
    a, b, c = (make_generator(5, i, "cpu") for i in (0, 0, 1))
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    assert not torch.equal(torch.rand(8, generator=make_generator(5, 0, "cpu")), torch.rand(8, generator=c))
    assert not torch.equal(
        torch.rand(8, generator=make_generator(5, 1, "cpu")), torch.rand(8, generator=make_generator(6, 0, "cpu"))
    )


@pytest.mark.parametrize("seeded", [False, True])
def test_statistical_sanity(seeded: bool) -> None:
    n = 20000
    logits = torch.tensor([1.0, 0.5, -0.3, 0.2])
    torch.manual_seed(1234)
    rows = seeded_rows(n, seed=1) if seeded else [row() for _ in range(n)]
    tokens, _ = Sampler()(logits.expand(n, -1), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert (freq - logits.softmax(-1)).abs().max().item() < 0.02


def test_seeded_single_row_over_steps_matches_softmax() -> None:
    logits = torch.tensor([[0.0, 1.0, -1.0]])
    sampler, r = Sampler(), row(make_generator(3, 0, "cpu"), seed=3)
    tokens = [sampler(logits, [r])[0][0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / len(tokens)
    assert (freq - logits[0].softmax(-1)).abs().max().item() < 0.03


def test_neg_inf_logits_are_safe() -> None:
    inf = float("-inf")
    logits = torch.tensor([[inf, 1.0, inf, 0.5], [inf, inf, inf, 2.0], [0.0, inf, inf, inf]])
    rows = [
        row(make_generator(0, 0, "cpu"), prompt=[0, 1], output=[2], repetition_penalty=1.5, frequency_penalty=0.3,
            logprobs=3),
        row(None, top_k=2, top_p=0.5, min_p=0.2, logprobs=2),
        row(temperature=0.0, presence_penalty=1.0, output=[0, 1], logprobs=1),
    ]
    for _ in range(50):
        tokens, lps = Sampler()(logits, rows)
        assert tokens[0] in (1, 3) and tokens[1] == 3 and tokens[2] == 0
        assert all(math.isfinite(lp.logprob) for lp in lps)


def test_low_precision_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 40).to(torch.bfloat16)
    tokens, lps = Sampler()(logits, [row(temperature=0.0, logprobs=1)] + seeded_rows(2, top_k=5))
    assert tokens[0] == logits.float()[0].argmax().item()
    assert abs(lps[0].logprob - logits.float().log_softmax(-1)[0, tokens[0]].item()) < 1e-6


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 4), [row()])
    assert Sampler()(torch.zeros(0, 4), []) == ([], [])


def hf_processors():  # noqa: ANN201 - the transformers module
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("name,kw,hf_arg", [
    ("TopKLogitsWarper", {"top_k": 7}, 7),
    ("TopPLogitsWarper", {"top_p": 0.8}, 0.8),
    ("MinPLogitsWarper", {"min_p": 0.1}, 0.1),
    ("TemperatureLogitsWarper", {"temperature": 0.7}, 0.7),
])
def test_filters_match_transformers(name: str, kw: dict, hf_arg: float) -> None:
    warper_cls = getattr(hf_processors(), name, None)
    if warper_cls is None:
        pytest.skip(f"transformers has no {name}")
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 2  # [B, V]
    ours = apply_filters(logits, [SamplingParams(**kw)] * 16)
    theirs = warper_cls(hf_arg)(torch.zeros(16, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(ours)
    assert torch.allclose(ours[finite], theirs[finite])


def test_filter_chain_matches_transformers() -> None:
    tf = hf_processors()
    names = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
    if not all(hasattr(tf, n) for n in names):
        pytest.skip("transformers lacks one of the warpers")
    torch.manual_seed(1)
    logits = torch.randn(16, 100) * 3  # [B, V]
    theirs = logits.clone()
    for proc in (tf.TemperatureLogitsWarper(0.8), tf.TopKLogitsWarper(20), tf.TopPLogitsWarper(0.9),
                 tf.MinPLogitsWarper(0.05)):
        theirs = proc(torch.zeros(16, 1, dtype=torch.long), theirs)
    ours = apply_filters(logits, [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)] * 16)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_repetition_penalty_matches_transformers() -> None:
    proc_cls = getattr(hf_processors(), "RepetitionPenaltyLogitsProcessor", None)
    if proc_cls is None:
        pytest.skip("transformers has no RepetitionPenaltyLogitsProcessor")
    torch.manual_seed(2)
    logits = torch.randn(4, 50) * 2  # [B, V]
    ids = torch.randint(0, 50, (4, 12))  # [B, L]
    rows = [row(prompt=ids[b, :8].tolist(), output=ids[b, 8:].tolist(), repetition_penalty=1.3) for b in range(4)]
    theirs = proc_cls(1.3)(ids, logits.clone())
    assert torch.equal(apply_penalties(logits, rows), theirs)


def test_precomputed_greedy_tokens_are_used_and_sampled_rows_written_into_them() -> None:
    """A decode graph hands its argmax in: greedy rows take it as it is (here deliberately not the argmax, to
    show it is used), sampled rows overwrite their entry in place (the next graph replay reads that buffer)."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
    greedy = torch.tensor([2, 1])
    rows = [row(temperature=0.0), row(make_generator(3, 0, "cpu"), temperature=1.0, top_k=1)]
    sample = Sampler().launch(logits, rows, greedy)
    assert sample.tokens is greedy
    assert sample.resolve()[0] == [2, 0]  # row 1 sampled its top-1 token into the buffer
    assert greedy.tolist() == [2, 0]


def test_precomputed_greedy_tokens_are_ignored_when_a_row_has_penalties() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    greedy = torch.tensor([1])
    rows = [row(temperature=0.0, repetition_penalty=100.0, output=[1])]  # token 1 falls to 0.05
    sample = Sampler().launch(logits, rows, greedy)
    assert sample.tokens is not greedy and sample.resolve()[0] == [2] and greedy.tolist() == [1]
