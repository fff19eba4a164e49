"""Requests handed over from a dead scheduler replica (AdoptRequest): whether one is taken on, and when an adopted
request whose workers never showed up is failed (pure: times and the known workers passed in)."""
from __future__ import annotations

import enum
from collections.abc import Callable, Container

from services.scheduler.inflight import RecentIds


class Adoption(enum.Enum):
    TAKE = "take"          # record it in flight; watched until its workers are known (see due_failures)
    ENDED = "ended"        # it finished on its worker before the handover came: nothing to do
    ABORTED = "aborted"    # its abort came before the handover: stop its legs


class Handovers:
    """What this scheduler remembers to judge handovers: recent aborts and ends of requests unknown here, and the
    adopted requests on workers not heard of yet, each with the time it is given up."""

    def __init__(self, memory_s: float, confirm_timeout_s: float) -> None:
        self.recent_aborts = RecentIds(memory_s)  # aborted while unknown here
        self.recent_finishes = RecentIds(memory_s)  # finished on their worker while unknown here
        self.confirm_timeout_s = confirm_timeout_s
        self._unconfirmed: dict[str, float] = {}  # adopted requests on workers not heard of yet → give-up time

    def note_abort(self, request_id: str, now_s: float) -> None:
        """A plain abort for a request neither queued nor in flight here."""
        self.recent_aborts.add(request_id, now_s)

    def note_finish(self, request_id: str, now_s: float) -> None:
        """RequestFinished (not a handoff) for a request not in flight here: another scheduler's, or not adopted yet."""
        self.recent_finishes.add(request_id, now_s)

    def on_adopt(self, request_id: str, legs: list[str], known: Container[str], now_s: float) -> Adoption:
        """legs: the worker ids the request runs on (decode, then prefill if any)."""
        if self.recent_finishes.pop(request_id, now_s):
            return Adoption.ENDED
        if self.recent_aborts.pop(request_id, now_s):
            return Adoption.ABORTED
        if any(w not in known for w in legs):  # NOTE: maybe just started; its heartbeat may come yet
            self._unconfirmed[request_id] = now_s + self.confirm_timeout_s
        return Adoption.TAKE

    def due_failures(self, now_s: float, legs_of: Callable[[str], list[str] | None],
                     known: Container[str]) -> list[str]:
        """Adopted requests to fail now: their workers were not heard of within confirm_timeout_s. Forgets the
        ones that ended (legs_of gives None) or whose workers are all known now."""
        due = []
        for request_id, give_up_s in list(self._unconfirmed.items()):
            legs = legs_of(request_id)
            if legs is None or all(w in known for w in legs):
                del self._unconfirmed[request_id]
            elif now_s >= give_up_s:
                del self._unconfirmed[request_id]
                due.append(request_id)
        return due

    def expire(self, now_s: float) -> None:
        self.recent_aborts.expire(now_s)
        self.recent_finishes.expire(now_s)

    def is_unconfirmed(self, request_id: str) -> bool:
        return request_id in self._unconfirmed

    def check_invariants(self, now_s: float) -> None:
        for request_id, give_up_s in self._unconfirmed.items():
            assert give_up_s <= now_s + self.confirm_timeout_s, request_id
        assert len(self.recent_aborts) <= self.recent_aborts.max_size
        assert len(self.recent_finishes) <= self.recent_finishes.max_size
