"""Routing policies: which live worker of the right model gets a request (pure: no I/O, time passed in).

A policy sees each worker as a Candidate: its registry entry, the requests this scheduler has on it that
have not finished, and how many leading blocks of the request's prompt the global index says it holds.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.scheduler.registry import WorkerInfo

ROUTABLE_ROLES = ("mixed",)  # prefill/decode workers are paired by the PD path, not routed to alone


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of one request at the moment it is routed."""

    request_id: str
    num_prompt_tokens: int
    num_blocks: int
    now_s: float  # the registry's clock (monotonic seconds)
    model_id: str | None = None  # None: any model
    num_cached_blocks: Mapping[str, int] = field(default_factory=dict)  # worker_id → prefix held (global index)


@dataclass(frozen=True)
class Candidate:
    worker: WorkerInfo
    num_in_flight: int = 0  # this scheduler's unfinished requests on the worker

    @property
    def num_active(self) -> int:
        """The worker's load as best known: its last report, or what this scheduler alone sent it since
        (a burst between two heartbeats), whichever is larger."""
        reported = self.worker.load.num_running + self.worker.load.num_waiting
        return max(reported, self.num_in_flight)


class RoutingPolicy(Protocol):
    def choose_worker(self, candidates: Sequence[Candidate], request: RouteRequest) -> str | None:
        """The worker_id to send request to, or None if no candidate may take it."""
        ...


@dataclass(frozen=True)
class LeastLoadPolicy:
    """Fewest running+waiting requests, then most free KV pages, then the smallest worker id."""

    heartbeat_timeout_s: float

    def choose_worker(self, candidates: Sequence[Candidate], request: RouteRequest) -> str | None:
        eligible = [c for c in candidates if is_eligible(c.worker, request, self.heartbeat_timeout_s)]
        if not eligible:
            return None
        best = min(eligible, key=lambda c: (c.num_active, -c.worker.load.num_free_pages, c.worker.worker_id))
        return best.worker.worker_id


def is_eligible(worker: WorkerInfo, request: RouteRequest, heartbeat_timeout_s: float) -> bool:
    """Alive, of a routable role, and serving the request's model (when it names one)."""
    return (worker.is_alive(request.now_s, heartbeat_timeout_s) and worker.role in ROUTABLE_ROLES
            and (request.model_id is None or worker.model_id == request.model_id))


POLICIES = {"least_load": LeastLoadPolicy}


def make_policy(name: str, heartbeat_timeout_s: float) -> RoutingPolicy:
    return POLICIES[name](heartbeat_timeout_s)
