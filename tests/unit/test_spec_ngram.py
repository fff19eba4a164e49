"""Unit tests for prompt-lookup proposals (spec/ngram.py): longest match first, most recent occurrence, truncation."""
from __future__ import annotations

import random

import pytest

from services.gpu_worker.spec.ngram import NgramProposer, lookup
from services.gpu_worker.spec.proposer import ProposalRequest, Proposer


def brute_force(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, written plainly: longest n first, then the latest earlier start of the last n tokens."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # "1 2 3" occurred at the start (then 7 8); "3" alone occurred later (then 5)
    ids = [1, 2, 3, 7, 8, 9, 3, 5, 6, 1, 2, 3]
    assert lookup(ids, 2) == [7, 8]
    assert lookup(ids, 2, max_n=1) == [5, 6]


def test_the_most_recent_occurrence_of_the_suffix_is_used() -> None:
    assert lookup([4, 5, 1, 4, 5, 2, 4, 5], 1) == [2]


def test_proposals_are_truncated_to_k_and_to_the_tokens_that_exist() -> None:
    ids = [1, 2, 3, 4, 5, 6, 1, 2]
    assert lookup(ids, 3) == [3, 4, 5]
    assert lookup(ids, 100) == [3, 4, 5, 6, 1, 2]
    assert lookup([7, 7, 7, 7], 5) == [7]  # the latest earlier "7 7 7" is followed by one token only


def test_no_match_k_zero_or_too_short_proposes_nothing() -> None:
    assert lookup([1, 2, 3, 4], 3) == []
    assert lookup([1, 2, 1, 2], 0) == []
    assert lookup([1], 3) == [] and lookup([], 3) == []
    assert lookup([5, 1, 2, 9, 1, 2], 2, min_n=3) == []  # only 2-token matches exist


@pytest.mark.parametrize("seed", range(20))
def test_lookup_matches_the_plain_definition_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(3) for _ in range(rng.randrange(0, 60))]
    for min_n, max_n in [(1, 4), (2, 3), (1, 1), (3, 6)]:
        for k in (0, 1, 4):
            assert lookup(ids, k, min_n, max_n) == brute_force(ids, k, min_n, max_n), (ids, k, min_n, max_n)


def test_ngram_proposer_implements_the_proposer_protocol_per_request() -> None:
    proposer: Proposer = NgramProposer(min_n=1, max_n=3)
    requests = [ProposalRequest([1, 2, 3, 1, 2], 2, "a"), ProposalRequest([1, 2, 3], 2, "b"),
                ProposalRequest([9, 8, 9], 0, "c")]
    assert proposer.propose(requests) == [[3, 1], [], []]
    proposer.forget("a")
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_a_long_sequence_is_searched_in_milliseconds() -> None:
    import time

    rng = random.Random(0)
    ids = [rng.randrange(32000) for _ in range(200_000)] + [11, 12, 13]
    ids[1000:1005] = [11, 12, 13, 14, 15]
    start = time.perf_counter()
    assert lookup(ids, 2) == [14, 15]
    assert time.perf_counter() - start < 0.5
