"""A tensor-parallel rank's radix cache: the LRU stamps come from rank 0's broadcast clock, so ranks evict alike."""
from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from services.gpu_worker.radix_cache import InsertResult, PrefixMatch, RadixCache


class LockstepRadixCache(RadixCache):
    """A TP rank's radix cache: its LRU stamps are rank 0's broadcast clock, not this rank's own.

    The engine and the batch policy hand `now` (read from this process's clock) down to match_prefix and
    insert, where it becomes last_access. The lockstep driver pins the value rank 0 broadcast before every
    op and step, so every rank stamps, and therefore evicts, alike.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pinned_now: float | None = None

    def pin_clock(self, now: float) -> None:
        self._pinned_now = now

    def _now(self, now: float) -> float:
        return now if self._pinned_now is None else self._pinned_now

    def match_prefix(self, token_ids: SequenceOf[int], now: float) -> PrefixMatch:
        return super().match_prefix(token_ids, self._now(now))

    def insert(self, token_ids: SequenceOf[int], page_ids: SequenceOf[int], now: float,
               after=None) -> InsertResult:
        return super().insert(token_ids, page_ids, self._now(now), after)
