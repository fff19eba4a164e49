"""The bounded FIFO of requests that arrived while no worker could take them, each with its deadline (pure).
It is bounded twice: by the number of requests (max_size) and by the prompt tokens they hold (max_tokens)."""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from shared.messages import TokenizedRequest


@dataclass(frozen=True)
class Waiting:
    request: TokenizedRequest
    deadline_s: float  # unix time after which it is failed (math.inf: never)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids)


def queue_deadline_s(now_s: float, max_wait_s: float, request_deadline_s: float | None) -> float:
    """When a request queued at now_s is failed: the sooner of now_s + max_wait_s (0: no limit) and the
    request's own deadline (None: none); math.inf when neither applies."""
    deadline_s = now_s + max_wait_s if max_wait_s > 0 else math.inf
    return deadline_s if request_deadline_s is None else min(deadline_s, request_deadline_s)


class WaitingQueue:
    def __init__(self, max_size: int, max_tokens: int) -> None:
        self.max_size = max_size
        self.max_tokens = max_tokens
        self.num_tokens = 0  # prompt tokens of every queued request
        self._items: OrderedDict[str, Waiting] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def push(self, request: TokenizedRequest, deadline_s: float) -> bool:
        """Queue request at the back; False (and not queued) when it would pass either bound.
        A request id already queued loses its old copy either way (the caller answers for the id).
        NOTE: an empty queue takes one prompt longer than max_tokens, so such a prompt is not refused for ever."""
        self.remove(request.request_id)
        waiting = Waiting(request, deadline_s)
        if len(self._items) >= self.max_size:
            return False
        if self._items and self.num_tokens + waiting.num_tokens > self.max_tokens:
            return False
        self._items[request.request_id] = waiting
        self.num_tokens += waiting.num_tokens
        return True

    def push_front(self, waiting: Waiting) -> None:
        """Put the request just popped back at the front (it could not be routed after all): it had its place,
        so the bounds are not checked again."""
        self.remove(waiting.request.request_id)
        self._items[waiting.request.request_id] = waiting
        self._items.move_to_end(waiting.request.request_id, last=False)
        self.num_tokens += waiting.num_tokens

    def pop(self) -> Waiting | None:
        """Remove and return the oldest request."""
        if not self._items:
            return None
        waiting = self._items.popitem(last=False)[1]
        self.num_tokens -= waiting.num_tokens
        return waiting

    def remove(self, request_id: str) -> bool:
        waiting = self._items.pop(request_id, None)
        if waiting is None:
            return False
        self.num_tokens -= waiting.num_tokens
        return True

    def pop_expired(self, now_s: float) -> list[Waiting]:
        """Remove and return, oldest first, every request whose deadline has passed."""
        expired = [w for w in self._items.values() if w.deadline_s <= now_s]
        for waiting in expired:
            self.remove(waiting.request.request_id)
        return expired

    def check_invariants(self) -> None:
        assert all(rid == w.request.request_id for rid, w in self._items.items())
        assert self.num_tokens == sum(w.num_tokens for w in self._items.values())
        assert len(self._items) <= self.max_size
        assert len(self._items) <= 1 or self.num_tokens <= self.max_tokens
