"""Routing policies: which live worker of the right model gets a request, and why (pure: no I/O, time passed in).

A policy sees each worker as a Candidate: its registry entry, the requests this scheduler has on it that
have not finished, and how many leading blocks of the request's prompt it holds (global index merged with
this scheduler's pending entries). `round_robin` and `least_load` ignore the prefix; `cache_aware` prices
each worker in tokens and keeps affinity from piling work onto one hot worker.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.scheduler.registry import WorkerInfo

ROUTABLE_ROLES = ("mixed",)  # prefill/decode workers are paired by the PD path, not routed to alone


class Reason(enum.Enum):
    AFFINITY = "affinity"  # the cheapest worker, and it holds more of the prompt than another eligible one
    LOAD = "load"          # chosen for load alone: no prefix advantage anywhere, or a load-only policy
    OVERLOAD = "overload"  # the cheapest worker was past the imbalance bound: the cheapest of the rest instead
    FALLBACK = "fallback"  # the global index could not be read: chosen for load alone (set by the shell)


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of one request at the moment it is routed."""

    request_id: str
    num_prompt_tokens: int
    num_blocks: int
    now_s: float  # the registry's clock (monotonic seconds)
    model_id: str | None = None  # None: any model
    num_cached_blocks: Mapping[str, int] = field(default_factory=dict)  # worker_id → leading blocks it holds


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: Reason
    num_cached_blocks: int  # leading blocks of the prompt the chosen worker holds


@dataclass(frozen=True)
class Candidate:
    worker: WorkerInfo
    num_in_flight: int = 0  # this scheduler's unfinished requests on the worker

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def num_active(self) -> int:
        """The worker's load as best known: its last report, or what this scheduler alone sent it since
        (a burst between two heartbeats), whichever is larger."""
        reported = self.worker.load.num_running + self.worker.load.num_waiting
        return max(reported, self.num_in_flight)

    @property
    def kv_use(self) -> float:
        """Fraction of the worker's KV pool in use (cached pages count as used), 0.0 to 1.0."""
        load = self.worker.load
        return 1.0 - load.num_free_pages / load.num_total_pages if load.num_total_pages > 0 else 0.0

    def load_key(self) -> tuple[int, int, str]:
        """Least-loaded first: fewest running+waiting requests, then most free KV pages, then the smallest id."""
        return self.num_active, -self.worker.load.num_free_pages, self.worker_id


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Decision | None:
        """Where to send request and why, or None if no candidate may take it."""
        ...


def is_eligible(worker: WorkerInfo, request: RouteRequest, heartbeat_timeout_s: float,
                roles: tuple[str, ...] = ROUTABLE_ROLES) -> bool:
    """Alive, not draining, of one of roles, and serving the request's model (when it names one)."""
    return (worker.is_alive(request.now_s, heartbeat_timeout_s) and not worker.is_draining and worker.role in roles
            and (request.model_id is None or worker.model_id == request.model_id))


def eligible_candidates(candidates: Sequence[Candidate], request: RouteRequest,
                        heartbeat_timeout_s: float, roles: tuple[str, ...] = ROUTABLE_ROLES) -> list[Candidate]:
    return [c for c in candidates if is_eligible(c.worker, request, heartbeat_timeout_s, roles)]


def _decision(candidate: Candidate, reason: Reason, request: RouteRequest) -> Decision:
    return Decision(candidate.worker_id, reason, request.num_cached_blocks.get(candidate.worker_id, 0))


@dataclass(frozen=True)
class LeastLoadPolicy:
    """Fewest running+waiting requests, then most free KV pages, then the smallest worker id."""

    heartbeat_timeout_s: float
    roles: tuple[str, ...] = ROUTABLE_ROLES

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Decision | None:
        eligible = eligible_candidates(candidates, request, self.heartbeat_timeout_s, self.roles)
        if not eligible:
            return None
        return _decision(min(eligible, key=Candidate.load_key), Reason.LOAD, request)


class RoundRobinPolicy:
    """The eligible workers in id order, one after another (the baseline that ignores load and prefixes)."""

    def __init__(self, heartbeat_timeout_s: float, roles: tuple[str, ...] = ROUTABLE_ROLES) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.roles = roles
        self._num_routed = 0

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Decision | None:
        eligible = sorted(eligible_candidates(candidates, request, self.heartbeat_timeout_s, self.roles),
                          key=lambda c: c.worker_id)
        if not eligible:
            return None
        chosen = eligible[self._num_routed % len(eligible)]
        self._num_routed += 1
        return _decision(chosen, Reason.LOAD, request)


@dataclass(frozen=True)
class CostWeights:
    """How cache_aware prices a worker, in prompt tokens, and how far affinity may unbalance the workers."""

    request_tokens: float = 64.0  # cost of each running or waiting request on the worker
    kv_use_tokens: float = 64.0  # cost of a full KV pool (scaled by the fraction in use)
    max_imbalance_ratio: float = 1.5  # a worker with more active requests than
    max_imbalance_requests: int = 4  # ratio × (the least-loaded worker's) + requests takes no work by affinity

    def is_overloaded(self, num_active: int, min_num_active: int) -> bool:
        return num_active > self.max_imbalance_ratio * min_num_active + self.max_imbalance_requests


@dataclass(frozen=True)
class CacheAwarePolicy:
    """The worker of least cost, where cost = prompt tokens it would have to prefill (those past its cached
    prefix) + its load (queued prompt tokens, active requests × request_tokens, KV use × kv_use_tokens).

    Hysteresis: a worker whose active requests exceed the bound `ratio × min + requests` (min over the
    eligible workers) is passed over, so a hot prefix spills to the next-cheapest worker instead of piling
    up. Ties go to the least-loaded worker.
    """

    heartbeat_timeout_s: float
    weights: CostWeights = CostWeights()
    roles: tuple[str, ...] = ROUTABLE_ROLES

    def cost_tokens(self, candidate: Candidate, request: RouteRequest) -> float:
        num_cached_blocks = request.num_cached_blocks.get(candidate.worker_id, 0)
        num_cached_tokens = min(request.num_prompt_tokens, num_cached_blocks * candidate.worker.page_size)
        load = candidate.worker.load
        load_tokens = (load.num_queued_tokens + candidate.num_active * self.weights.request_tokens
                       + candidate.kv_use * self.weights.kv_use_tokens)
        return request.num_prompt_tokens - num_cached_tokens + load_tokens

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Decision | None:
        eligible = eligible_candidates(candidates, request, self.heartbeat_timeout_s, self.roles)
        if not eligible:
            return None
        min_num_active = min(c.num_active for c in eligible)
        allowed = [c for c in eligible if not self.weights.is_overloaded(c.num_active, min_num_active)]
        cheapest = min(eligible, key=lambda c: (self.cost_tokens(c, request), c.load_key()))
        chosen = min(allowed, key=lambda c: (self.cost_tokens(c, request), c.load_key()))
        if chosen is not cheapest:
            return _decision(chosen, Reason.OVERLOAD, request)
        cached = [request.num_cached_blocks.get(c.worker_id, 0) for c in eligible]
        has_advantage = request.num_cached_blocks.get(chosen.worker_id, 0) > min(cached)
        return _decision(chosen, Reason.AFFINITY if has_advantage else Reason.LOAD, request)


POLICIES = ("cache_aware", "least_load", "round_robin")


def make_policy(name: str, heartbeat_timeout_s: float, weights: CostWeights = CostWeights(),
                roles: tuple[str, ...] = ROUTABLE_ROLES) -> RoutingPolicy:
    """The named policy over workers of these roles (default: mixed workers only)."""
    if name == "cache_aware":
        return CacheAwarePolicy(heartbeat_timeout_s, weights, roles)
    if name == "least_load":
        return LeastLoadPolicy(heartbeat_timeout_s, roles)
    if name == "round_robin":
        return RoundRobinPolicy(heartbeat_timeout_s, roles)
    raise ValueError(f"unknown routing policy {name!r}; one of {', '.join(POLICIES)}")
