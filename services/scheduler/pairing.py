"""PD pairing: per request, prefill on a prefill worker and decode on a decode worker, or run it whole on one
decode/mixed worker (pure: no I/O, time passed in).

    --pd-policy never   every request runs on one mixed/decode worker (it prefills locally)
    --pd-policy always  every request is split when a prefill and a decode worker are up
    --pd-policy auto    split only when the local worker would have to prefill at least
                        min_prefill_tokens uncached tokens: short or mostly-cached prompts stay local,
                        where the handoff would cost more than the prefill it moves away

The prefill worker is the cheapest by cache-aware cost over prefill workers (prefix it holds, its
load); the decode worker likewise over decode and mixed workers (what it holds is what it need not pull).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.policy import CacheAwarePolicy, Candidate, CostWeights, Decision, RouteRequest, RoutingPolicy

PD_POLICIES = ("auto", "always", "never")
LOCAL_ROLES = ("mixed", "decode")
PREFILL_ROLES = ("prefill",)
DECODE_ROLES = ("decode", "mixed")


class PairReason(enum.Enum):
    PD = "pd"  # split: prefill worker, then decode worker
    SHORT = "short"  # auto: fewer than min_prefill_tokens uncached tokens on the local worker
    NEVER = "never"  # --pd-policy never
    NO_PREFILL_WORKER = "no_prefill_worker"  # no live prefill (or decode) worker: local
    MULTI_SAMPLE = "multi_sample"  # n > 1 requests are not handed off


@dataclass(frozen=True)
class Pairing:
    decode: Decision  # where the request decodes (and, when prefill is None, prefills too)
    prefill: Decision | None
    reason: PairReason

    @property
    def is_split(self) -> bool:
        return self.prefill is not None


@dataclass
class PairingPolicy:
    mode: str
    local: RoutingPolicy  # over LOCAL_ROLES: the configured routing policy
    prefill: RoutingPolicy  # over PREFILL_ROLES
    decode: RoutingPolicy  # over DECODE_ROLES
    min_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        if self.mode not in PD_POLICIES:
            raise ValueError(f"pd policy must be one of {', '.join(PD_POLICIES)}, not {self.mode!r}")

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest, num_samples: int = 1) -> Pairing | None:
        """The pairing for request, or None when no worker may take it now."""
        if self.mode == "never" or num_samples > 1:
            reason = PairReason.NEVER if self.mode == "never" else PairReason.MULTI_SAMPLE
            return self._local(candidates, request, reason)
        prefill = self.prefill.choose(candidates, request)
        decode = self.decode.choose(candidates, request) if prefill is not None else None
        if prefill is None or decode is None:
            return self._local(candidates, request, PairReason.NO_PREFILL_WORKER)
        if self.mode == "auto":
            local = self.local.choose(candidates, request)
            if local is not None and uncached_tokens(local, candidates, request) < self.min_prefill_tokens:
                return Pairing(local, None, PairReason.SHORT)
        return Pairing(decode, prefill, PairReason.PD)

    def _local(self, candidates: Sequence[Candidate], request: RouteRequest, reason: PairReason) -> Pairing | None:
        local = self.local.choose(candidates, request)
        return None if local is None else Pairing(local, None, reason)


def uncached_tokens(decision: Decision, candidates: Sequence[Candidate], request: RouteRequest) -> int:
    """Prompt tokens the chosen worker would prefill itself (those past its cached prefix)."""
    page_size = next(c.worker.page_size for c in candidates if c.worker_id == decision.worker_id)
    return request.num_prompt_tokens - min(request.num_prompt_tokens, decision.num_cached_blocks * page_size)


def make_pairing(mode: str, local: RoutingPolicy, heartbeat_timeout_s: float, weights: CostWeights = CostWeights(),
                 min_prefill_tokens: int = 256) -> PairingPolicy:
    return PairingPolicy(mode, local, CacheAwarePolicy(heartbeat_timeout_s, weights, PREFILL_ROLES),
                         CacheAwarePolicy(heartbeat_timeout_s, weights, DECODE_ROLES), min_prefill_tokens)
