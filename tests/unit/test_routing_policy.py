"""The routing policies (round_robin, least_load, cache_aware) and the pending prefix entries: exact choices and
reasons, and hypothesis properties: never an ineligible worker, longest prefix wins at equal load, bounded
imbalance under a Zipf prefix distribution, pending entries expire."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.pending import PendingPrefixes, merge_prefixes
from services.scheduler.policy import (CacheAwarePolicy, Candidate, CostWeights, Decision, Reason, RoundRobinPolicy,
                                       RouteRequest, make_policy)
from services.scheduler.registry import WorkerInfo
from shared.messages import WorkerLoad

TIMEOUT_S = 3.0
NOW_S = 100.0
PAGE = 16
AFFINITY_ONLY = CostWeights(request_tokens=0.0, kv_use_tokens=0.0)  # isolates the hysteresis


def load(running: int = 0, waiting: int = 0, free: int = 100, queued_tokens: int = 0) -> WorkerLoad:
    return WorkerLoad(num_running=running, num_waiting=waiting, num_queued_tokens=queued_tokens,
                      num_free_pages=free, num_total_pages=100)


def info(worker_id: str, last_seen_s: float = NOW_S, model_id: str = "m", role: str = "mixed",
         worker_load: WorkerLoad | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id, "i1", f"ipc://{worker_id}", model_id, role, PAGE, worker_load or load(),
                      last_seen_s)


def route(cached: dict[str, int] | None = None, num_blocks: int = 4, model_id: str | None = None) -> RouteRequest:
    return RouteRequest("r", num_prompt_tokens=num_blocks * PAGE + 3, num_blocks=num_blocks, now_s=NOW_S,
                        model_id=model_id, num_cached_blocks=cached or {})


def idle(*worker_ids: str) -> list[Candidate]:
    return [Candidate(info(w)) for w in worker_ids]


# --- cache_aware ------------------------------------------------------------------------------------------

def test_cache_aware_prices_uncached_prefill_against_load() -> None:
    policy = CacheAwarePolicy(TIMEOUT_S)  # 64 tokens per active request, 64 for a full KV pool
    request = route({"a": 3}, num_blocks=4)  # 67 prompt tokens; a holds 48 of them
    assert policy.cost_tokens(Candidate(info("a")), request) == 19
    assert policy.cost_tokens(Candidate(info("b", worker_load=load(free=50, queued_tokens=10))), request) == 109
    assert policy.choose(idle("a", "b"), request) == Decision("a", Reason.AFFINITY, 3)
    busy_a = [Candidate(info("a", worker_load=load(running=1))), Candidate(info("b"))]
    assert policy.choose(busy_a, request) == Decision("b", Reason.LOAD, 0)  # 19 + 64 > 67
    assert policy.choose(busy_a, route({"a": 4}, num_blocks=4)) == Decision("b", Reason.LOAD, 0)  # 3 + 64 = 67: tie
    assert policy.choose(busy_a, route({"a": 8}, num_blocks=8)) == Decision("a", Reason.AFFINITY, 8)  # 3 + 64 < 131


def test_cache_aware_counts_its_own_in_flight_between_heartbeats() -> None:
    policy = CacheAwarePolicy(TIMEOUT_S)
    candidates = [Candidate(info("a"), num_in_flight=2), Candidate(info("b"), num_in_flight=1)]
    assert policy.choose(candidates, route()) == Decision("b", Reason.LOAD, 0)


def test_cache_aware_hysteresis_spills_an_overloaded_affinity_worker_to_the_next_cheapest() -> None:
    policy = CacheAwarePolicy(TIMEOUT_S, AFFINITY_ONLY)  # bound: 1.5 × min + 4 active requests
    cached = route({"a": 4, "b": 2})

    def candidates(a_active: int, others_active: int) -> list[Candidate]:
        return [Candidate(info("a"), a_active), Candidate(info("b"), others_active),
                Candidate(info("c"), others_active)]

    assert policy.choose(candidates(4, 0), cached) == Decision("a", Reason.AFFINITY, 4)
    assert policy.choose(candidates(5, 0), cached) == Decision("b", Reason.OVERLOAD, 2)
    assert policy.choose(candidates(7, 2), cached) == Decision("a", Reason.AFFINITY, 4)
    assert policy.choose(candidates(8, 2), cached) == Decision("b", Reason.OVERLOAD, 2)
    wide = CacheAwarePolicy(TIMEOUT_S, CostWeights(0.0, 0.0, max_imbalance_ratio=2.0, max_imbalance_requests=0))
    assert wide.choose(candidates(4, 2), cached).worker_id == "a"
    assert wide.choose(candidates(5, 2), cached).worker_id == "b"


def test_cache_aware_without_a_prefix_advantage_routes_by_load() -> None:
    policy = CacheAwarePolicy(TIMEOUT_S)
    candidates = [Candidate(info("a", worker_load=load(running=1))), Candidate(info("b", worker_load=load(free=60))),
                  Candidate(info("c", worker_load=load(free=90)))]
    assert policy.choose(candidates, route()) == Decision("c", Reason.LOAD, 0)
    assert policy.choose(candidates, route({"a": 2, "b": 2, "c": 2})) == Decision("c", Reason.LOAD, 2)
    equal = idle("b", "a")
    assert policy.choose(equal, route()) == Decision("a", Reason.LOAD, 0)  # a tie goes to the smaller id


def test_round_robin_cycles_the_eligible_workers_in_id_order() -> None:
    policy = RoundRobinPolicy(TIMEOUT_S)
    candidates = idle("c", "a") + [Candidate(info("dead", last_seen_s=NOW_S - 4)), Candidate(info("b"))]
    picks = [policy.choose(candidates, route({"c": 4})) for _ in range(4)]
    assert [d.worker_id for d in picks] == ["a", "b", "c", "a"]
    assert {d.reason for d in picks} == {Reason.LOAD} and picks[2].num_cached_blocks == 4
    assert policy.choose(candidates[2:3], route()) is None


def test_make_policy_knows_the_three_names() -> None:
    assert [type(make_policy(n, TIMEOUT_S)).__name__ for n in ("cache_aware", "least_load", "round_robin")] == \
        ["CacheAwarePolicy", "LeastLoadPolicy", "RoundRobinPolicy"]
    with pytest.raises(ValueError):
        make_policy("random", TIMEOUT_S)


worker_strategy = st.builds(
    info, worker_id=st.sampled_from("abcdefgh"), last_seen_s=st.floats(NOW_S - 10, NOW_S),
    model_id=st.sampled_from(["m", "n"]), role=st.sampled_from(["mixed", "prefill", "decode"]),
    worker_load=st.builds(load, st.integers(0, 9), st.integers(0, 9), st.integers(0, 100), st.integers(0, 500)))


@settings(max_examples=300)
@given(name=st.sampled_from(["cache_aware", "least_load", "round_robin"]),
       workers=st.lists(worker_strategy, max_size=8, unique_by=lambda w: w.worker_id),
       in_flight=st.lists(st.integers(0, 12), min_size=8, max_size=8),
       cached=st.dictionaries(st.sampled_from("abcdefghz"), st.integers(0, 8)),
       model_id=st.sampled_from([None, "m", "n"]), num_calls=st.integers(1, 3))
def test_no_policy_ever_picks_a_dead_mismatched_or_unroutable_worker(
        name: str, workers: list[WorkerInfo], in_flight: list[int], cached: dict[str, int], model_id: str | None,
        num_calls: int) -> None:
    policy = make_policy(name, TIMEOUT_S)
    candidates = [Candidate(w, n) for w, n in zip(workers, in_flight)]
    request = route(cached, num_blocks=8, model_id=model_id)
    eligible = {c.worker_id for c in candidates if NOW_S - c.worker.last_seen_s <= TIMEOUT_S
                and c.worker.role == "mixed" and model_id in (None, c.worker.model_id)}
    for _ in range(num_calls):
        decision = policy.choose(candidates, request)
        assert (decision is None) == (not eligible)
        if decision is not None:
            assert decision.worker_id in eligible
            assert decision.num_cached_blocks == cached.get(decision.worker_id, 0)


@given(cached=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 8)),
       active=st.integers(0, 6), free=st.integers(0, 100), queued=st.integers(0, 300))
def test_cache_aware_picks_the_longest_prefix_when_loads_are_equal(cached: dict[str, int], active: int, free: int,
                                                                   queued: int) -> None:
    same = load(running=active, free=free, queued_tokens=queued)
    candidates = [Candidate(info(w, worker_load=same)) for w in "abcd"]
    decision = CacheAwarePolicy(TIMEOUT_S).choose(candidates, route(cached, num_blocks=8))
    longest = max(cached.get(w, 0) for w in "abcd")
    assert decision.num_cached_blocks == longest
    assert decision.worker_id == min(w for w in "abcd" if cached.get(w, 0) == longest)
    assert decision.reason is (Reason.AFFINITY if longest > min(cached.get(w, 0) for w in "abcd") else Reason.LOAD)


def zipf_choice(rng: random.Random, num_items: int, exponent: float) -> int:
    return rng.choices(range(num_items), weights=[1 / (k + 1) ** exponent for k in range(num_items)])[0]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_requests=st.integers(1, 400), exponent=st.floats(0.8, 2.5),
       weights=st.sampled_from([AFFINITY_ONLY, CostWeights(), CostWeights(16.0, 0.0, 1.2, 2)]),
       finish_rate=st.sampled_from([0.0, 0.5, 0.9]))
def test_cache_aware_imbalance_stays_bounded_under_zipf_prefixes(seed: int, num_requests: int, exponent: float,
                                                                 weights: CostWeights, finish_rate: float) -> None:
    """N requests over 4 workers, each a Zipf-chosen shared prefix of 1-8 blocks plus a private block; a worker
    holds every block routed to it; its load is its unfinished requests. At every decision the chosen worker is
    within the bound; while nothing finishes, max − min stays within (ratio − 1) × min + requests + 1
    (written max <= ratio × min + requests + 1, as the policy computes it)."""
    rng = random.Random(seed)
    prefixes = [[1000 * p + b for b in range(rng.randint(1, 8))] for p in range(16)]
    policy = CacheAwarePolicy(TIMEOUT_S, weights)
    held = {w: set() for w in "abcd"}
    running: dict[str, list[int]] = {w: [] for w in "abcd"}
    for i in range(num_requests):
        if finish_rate and rng.random() < finish_rate:
            busy = [w for w in "abcd" if running[w]]
            if busy:
                running[rng.choice(busy)].pop(0)
        chain = prefixes[zipf_choice(rng, len(prefixes), exponent)] + [-1 - i]
        cached = {w: next((k for k, h in enumerate(chain) if h not in held[w]), len(chain)) for w in "abcd"}
        candidates = [Candidate(info(w, worker_load=load(running=len(running[w]))), len(running[w])) for w in "abcd"]
        request = RouteRequest(f"r{i}", len(chain) * PAGE, len(chain), NOW_S, num_cached_blocks=cached)
        decision = policy.choose(candidates, request)
        min_active = min(len(r) for r in running.values())
        assert len(running[decision.worker_id]) <= weights.max_imbalance_ratio * min_active + \
            weights.max_imbalance_requests
        running[decision.worker_id].append(i)
        held[decision.worker_id].update(chain)
        if not finish_rate:
            loads = [len(r) for r in running.values()]
            assert max(loads) <= weights.max_imbalance_ratio * min(loads) + weights.max_imbalance_requests + 1


def test_cache_aware_keeps_a_hot_prefix_on_few_workers_where_round_robin_sprays_it() -> None:
    """The same burst as above, without finishes: cache_aware prefills each shared block on fewer workers."""
    def prefills(name: str) -> int:
        rng, policy = random.Random(7), make_policy(name, TIMEOUT_S, AFFINITY_ONLY)
        prefixes = [[1000 * p + b for b in range(8)] for p in range(8)]
        held, running, num_prefilled = {w: set() for w in "abcd"}, dict.fromkeys("abcd", 0), 0
        for i in range(200):
            chain = prefixes[zipf_choice(rng, len(prefixes), 1.2)]
            cached = {w: next((k for k, h in enumerate(chain) if h not in held[w]), len(chain)) for w in "abcd"}
            candidates = [Candidate(info(w), running[w]) for w in "abcd"]
            worker_id = policy.choose(candidates, RouteRequest(f"r{i}", 128, 8, NOW_S, num_cached_blocks=cached)
                                      ).worker_id
            num_prefilled += len(chain) - cached[worker_id]
            running[worker_id] += 1
            held[worker_id].update(chain)
        return num_prefilled

    assert prefills("cache_aware") < prefills("round_robin") / 2


# --- pending prefix entries -------------------------------------------------------------------------------

def test_pending_entries_give_the_longest_pending_prefix_and_expire() -> None:
    pending = PendingPrefixes(ttl_s=5.0)
    pending.add([1, 2, 3], "a", now_s=10.0)
    pending.add([1, 2], "b", now_s=12.0)
    pending.add([], "c", now_s=12.0)
    pending.check_invariants()
    assert (len(pending), pending.longest_prefix([1, 2, 3, 4], now_s=12.0)) == (5, {"a": 3, "b": 2})
    assert pending.longest_prefix([2, 3], now_s=12.0) == {"a": 2, "b": 1}
    assert pending.longest_prefix([9, 1], now_s=12.0) == {} and pending.longest_prefix([], now_s=12.0) == {}
    assert pending.longest_prefix([1, 2, 3], now_s=15.0) == {"b": 2}  # a's entries expire at exactly 15.0
    pending.add([1], "b", now_s=16.0)  # refreshes block 1 only
    assert pending.longest_prefix([1, 2], now_s=17.0) == {"b": 1}
    pending.check_invariants()
    pending.expire(21.0)
    assert len(pending) == 0 and pending.longest_prefix([1], now_s=21.0) == {}
    pending.check_invariants()


def test_pending_entries_are_capped_oldest_first() -> None:
    pending = PendingPrefixes(ttl_s=5.0, max_entries=4)
    pending.add([1, 2], "a", now_s=0.0)
    pending.add([1, 2], "b", now_s=1.0)
    pending.add([3], "a", now_s=2.0)
    assert len(pending) == 3
    pending.check_invariants()
    assert pending.longest_prefix([1, 2], now_s=2.0) == {"b": 2}
    assert pending.longest_prefix([3], now_s=2.0) == {"a": 1}


@given(st.lists(st.tuples(st.sampled_from(["add", "lookup"]), st.lists(st.integers(0, 5), max_size=4, unique=True),
                          st.sampled_from("ab"), st.floats(0.0, 3.0)), max_size=40))
def test_pending_entries_match_a_model_of_expiry_times(ops: list[tuple[str, list[int], str, float]]) -> None:
    pending, model, now_s = PendingPrefixes(ttl_s=2.0), {}, 0.0
    for op, hashes, worker_id, advance_s in ops:
        now_s += advance_s
        if op == "add":
            pending.add(hashes, worker_id, now_s)
            model.update({(h, worker_id): now_s + 2.0 for h in hashes})
        else:
            live = {k for k, expiry_s in model.items() if expiry_s > now_s}
            expected = {}
            for w in "ab":
                depth = next((k for k, h in enumerate(hashes) if (h, w) not in live), len(hashes))
                if depth:
                    expected[w] = depth
            assert pending.longest_prefix(hashes, now_s) == expected
            assert len(pending) == len(live)
        pending.check_invariants()


def test_merge_prefixes_keeps_the_longest_per_worker() -> None:
    assert merge_prefixes({"a": 2, "b": 5}, {"a": 3, "c": 1}, {}) == {"a": 3, "b": 5, "c": 1}
