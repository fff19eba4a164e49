"""Prompt lookup: draft tokens copied from where the sequence's own recent tokens occurred before.

Summaries, code edits, RAG answers and multi-turn chats repeat long spans of their own context; when the last n
tokens occurred earlier in the sequence (prompt or output), the tokens that followed them then are a good guess
for what follows now, and costs no model at all (Saxena's prompt lookup decoding; vLLM's "[ngram]" method).

The search is longest-first (max_n down to min_n) and takes the most recent earlier occurrence: recent context
predicts best. It is stateless and vectorised with numpy: match_n[e] says that the n tokens ending at position e
equal the sequence's last n tokens, and match_n = match_(n-1) & (one more column compared), so all n cost
O(max_n * L) elementwise work per sequence of length L (plus the O(L) conversion of a Python list) — about a
millisecond for L = 100k, well below a decode step; no per-sequence index to keep in sync or forget.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.gpu_worker.spec.proposer import ProposalRequest


def lookup(token_ids: Sequence[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    ids = np.asarray(token_ids, dtype=np.int64)  # [L]
    length = len(ids)
    if k <= 0 or length < 2:
        return []
    # match[e]: the occurrence ending at e equals the suffix; e <= L - 2 so at least one token follows it
    match = ids[:-1] == ids[-1]  # [L-1]: match_1
    found: list[int | None] = []  # found[n-1]: the last e where match_n holds
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:  # the occurrence's n-th token from the end, ids[e-n+1], against ids[L-n]; e >= n-1 to exist
            match[:n - 1] = False
            match[n - 1:] &= ids[:length - n] == ids[length - n]
        hits = np.flatnonzero(match)
        if len(hits) == 0:
            break  # no occurrence of length n means none longer either
        found.append(int(hits[-1]))
    if len(found) < max(min_n, 1):
        return []
    end = found[-1]  # the longest n found; found[n-1] exists for every n up to it
    return ids[end + 1:end + 1 + k].tolist()


class NgramProposer:
    """Proposer (proposer.Proposer) by prompt lookup over each sequence's own tokens; stateless."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        return [lookup(r.token_ids, r.k, self.min_n, self.max_n) for r in requests]

    def forget(self, request_id: str, index: int = 0) -> None:
        """Nothing is kept per sequence."""
