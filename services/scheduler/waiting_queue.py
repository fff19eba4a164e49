"""The bounded FIFO of requests that arrived while no worker could take them, each with its deadline (pure)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.messages import TokenizedRequest


@dataclass(frozen=True)
class Waiting:
    request: TokenizedRequest
    deadline_s: float  # unix time after which it is failed


class WaitingQueue:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, Waiting] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def push(self, request: TokenizedRequest, deadline_s: float) -> bool:
        """Queue request at the back; False (and not queued) when full."""
        if len(self._items) >= self.max_size and request.request_id not in self._items:
            return False
        self._items.pop(request.request_id, None)
        self._items[request.request_id] = Waiting(request, deadline_s)
        return True

    def push_front(self, waiting: Waiting) -> None:
        """Put a popped request back at the front (it could not be routed after all)."""
        self._items[waiting.request.request_id] = waiting
        self._items.move_to_end(waiting.request.request_id, last=False)

    def pop(self) -> Waiting | None:
        """Remove and return the oldest request."""
        if not self._items:
            return None
        return self._items.popitem(last=False)[1]

    def remove(self, request_id: str) -> bool:
        return self._items.pop(request_id, None) is not None

    def pop_expired(self, now_s: float) -> list[Waiting]:
        """Remove and return, oldest first, every request whose deadline has passed."""
        expired = [w for w in self._items.values() if w.deadline_s <= now_s]
        for waiting in expired:
            del self._items[waiting.request.request_id]
        return expired

    def check_invariants(self) -> None:
        assert len(self._items) <= self.max_size
        assert all(rid == w.request.request_id for rid, w in self._items.items())
