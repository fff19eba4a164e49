"""The replay proposer (spec/replay.py): recorded continuations, each draft true with probability alpha, none once a
sequence has left its record."""
from __future__ import annotations

import pytest

from services.gpu_worker.spec.proposer import ProposalRequest
from services.gpu_worker.spec.replay import ReplayProposer

RECORDS = {(1, 2, 3): [7, 8, 9, 10, 11], (1, 2): [5, 6]}


def test_drafts_follow_the_record_from_the_sequence_position() -> None:
    proposer = ReplayProposer(RECORDS, 1.0, vocab_size=16)
    got = proposer.propose([ProposalRequest([1, 2, 3], 3), ProposalRequest([1, 2, 3, 7, 8], 4),
                            ProposalRequest([1, 2, 5], 4)])
    assert got == [[7, 8, 9], [9, 10, 11], [6]]
    assert (proposer.num_proposed, proposer.num_true) == (3 + 3 + 1, 7)


def test_alpha_zero_makes_every_draft_wrong() -> None:
    proposer = ReplayProposer(RECORDS, 0.0, vocab_size=11)
    assert proposer.propose([ProposalRequest([1, 2, 3, 7], 4)]) == [[9, 10, 0, 1]]  # (true + 1) mod 11
    assert (proposer.num_proposed, proposer.num_true) == (4, 0)


def test_the_true_share_follows_alpha_and_the_seed() -> None:
    def drafts(seed: int) -> list[list[int]]:
        proposer = ReplayProposer({(0,): list(range(1, 401))}, 0.8, vocab_size=1000, seed=seed)
        out = [proposer.propose([ProposalRequest([0] + list(range(1, i + 1)), 4)])[0] for i in range(0, 396)]
        assert 0.75 < proposer.num_true / proposer.num_proposed < 0.85
        return out

    assert drafts(1) == drafts(1) != drafts(2)


def test_a_sequence_off_its_record_gets_no_drafts() -> None:
    proposer = ReplayProposer(RECORDS, 1.0, vocab_size=16)
    assert proposer.propose([ProposalRequest([1, 2, 3, 7, 4], 2), ProposalRequest([1, 2, 3, 7], 2)]) == [[], [8, 9]]
    assert proposer.num_diverged == 1
    with pytest.raises(KeyError):
        proposer.propose([ProposalRequest([9, 9], 2)])
    with pytest.raises(ValueError):
        ReplayProposer(RECORDS, 1.5, vocab_size=16)
