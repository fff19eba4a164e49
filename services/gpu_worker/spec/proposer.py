"""The proposer interface: what the engine loop asks of any speculative-decoding proposer.

The engine asks each step for up to k draft tokens per running sequence, scores them with the target model in one
pass and verifies them (verify.verify). Every way of guessing tokens — prompt lookup (ngram.NgramProposer), a small
draft model, an EAGLE-style head over the target's hidden states — implements this one Protocol, so adding one
never changes the engine loop: it only changes which Proposer the engine was built with.

A proposer may return fewer than k tokens, or none (nothing to propose, or a budget ran out); the engine then
verifies what it got, and a row with none is plain decoding. Proposers that keep state per sequence (a draft
model's KV cache, an incremental index) key it by (request_id, index) and drop it in forget().
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ProposalRequest:
    """One sequence that wants draft tokens this step."""

    token_ids: Sequence[int]  # prompt + output so far (the last one is the token the next forward pass feeds)
    k: int  # how many draft tokens are wanted; 0: none
    request_id: str = ""  # with index, the sequence's identity for proposers that keep state per sequence
    index: int = 0  # which of the request's n sequences


class Proposer(Protocol):
    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """Per request, at most request.k draft tokens to follow request.token_ids (possibly none)."""
        ...

    def forget(self, request_id: str, index: int = 0) -> None:
        """The sequence finished or was aborted: drop any state kept for it (stateless proposers do nothing)."""
        ...
