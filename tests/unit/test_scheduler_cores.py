"""Pure cores of the scheduler (registry, policy, in-flight table, waiting queue) and of cache_index (the
event sequencer): exact decisions, with hypothesis driving random sequences against simple models."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cache_index.sequencer import Action, Sequencer
from services.scheduler.config import SchedulerConfig
from services.scheduler.inflight import InFlight, InFlightTable
from services.scheduler.policy import Candidate, LeastLoadPolicy, Reason, RouteRequest, make_policy
from services.scheduler.registry import HeartbeatKind, Registry, WorkerInfo
from services.scheduler.waiting_queue import WaitingQueue, queue_deadline_s
from shared.messages import (AllBlocksCleared, BlocksRemoved, BlocksStored, CacheSnapshot, KVEvent, KVEventBatch,
                             SamplingSpec, TokenizedRequest, WorkerHeartbeat, WorkerLoad)

TIMEOUT_S = 3.0


def load(running: int = 0, waiting: int = 0, free: int = 100) -> WorkerLoad:
    return WorkerLoad(num_running=running, num_waiting=waiting, num_queued_tokens=0, num_free_pages=free,
                      num_total_pages=100)


def heartbeat(worker_id: str, incarnation: str = "i1", model_id: str = "m", role: str = "mixed",
              worker_load: WorkerLoad | None = None) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id, incarnation, f"ipc://{worker_id}", model_id, role, 16, worker_load or load())


def info(worker_id: str, last_seen_s: float = 100.0, model_id: str = "m", role: str = "mixed",
         worker_load: WorkerLoad | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id, "i1", f"ipc://{worker_id}", model_id, role, 16, worker_load or load(), last_seen_s)


def route(now_s: float = 100.0, model_id: str | None = None) -> RouteRequest:
    return RouteRequest("r1", num_prompt_tokens=32, num_blocks=2, now_s=now_s, model_id=model_id)


def chosen(policy, candidates: list[Candidate], request: RouteRequest) -> str | None:
    decision = policy.choose(candidates, request)
    return None if decision is None else decision.worker_id


def tokenized(request_id: str) -> TokenizedRequest:
    return TokenizedRequest(request_id, [1, 2, 3], [], SamplingSpec(), "ipc://tok", 0.0)


# --- registry ---------------------------------------------------------------------------------------------

def test_registry_heartbeat_kinds_and_expiry() -> None:
    reg = Registry()
    assert reg.on_heartbeat(heartbeat("a"), 1.0) == (HeartbeatKind.NEW, None)
    assert reg.on_heartbeat(heartbeat("b", model_id="n"), 1.5) == (HeartbeatKind.NEW, None)
    assert reg.on_heartbeat(heartbeat("a", worker_load=load(running=3)), 2.0) == (HeartbeatKind.UPDATED, None)
    assert reg.get("a").load.num_running == 3 and reg.get("a").last_seen_s == 2.0
    kind, old = reg.on_heartbeat(heartbeat("a", incarnation="i2"), 2.5)
    assert kind is HeartbeatKind.RESTARTED and old.incarnation == "i1" and reg.get("a").incarnation == "i2"
    assert reg.model_ids() == ["m", "n"]
    reg.check_invariants()
    assert reg.expire(now_s=4.5, timeout_s=TIMEOUT_S) == []  # b last seen 1.5: exactly 3.0 ago is alive
    assert [w.worker_id for w in reg.expire(now_s=4.6, timeout_s=TIMEOUT_S)] == ["b"]
    assert [w.worker_id for w in reg.workers()] == ["a"] and "b" not in reg
    assert [w.worker_id for w in reg.expire(now_s=6.0, timeout_s=TIMEOUT_S)] == ["a"]
    assert len(reg) == 0 and reg.model_ids() == []
    assert reg.on_heartbeat(heartbeat("a", incarnation="i2"), 7.0) == (HeartbeatKind.NEW, None)
    assert reg.remove("a").worker_id == "a" and reg.remove("a") is None


# --- policy -----------------------------------------------------------------------------------------------

def test_least_load_prefers_fewest_active_then_free_pages_then_id() -> None:
    policy = LeastLoadPolicy(TIMEOUT_S)
    a = info("a", worker_load=load(running=2, waiting=1, free=90))
    b = info("b", worker_load=load(running=1, waiting=1, free=10))
    c = info("c", worker_load=load(running=2, free=50))
    assert chosen(policy, [Candidate(a), Candidate(b)], route()) == "b"
    assert chosen(policy, [Candidate(a), Candidate(b), Candidate(c)], route()) == "c"  # 2 = 2: pages
    d = info("d", worker_load=load(running=2, free=50))
    e = info("e", worker_load=load(running=2, free=60))
    assert chosen(policy, [Candidate(d), Candidate(c)], route()) == "c"  # equal load and pages: id
    assert chosen(policy, [Candidate(d), Candidate(c), Candidate(e)], route()) == "e"  # more free pages


def test_least_load_counts_own_in_flight_between_heartbeats() -> None:
    policy = LeastLoadPolicy(TIMEOUT_S)
    a, b = info("a"), info("b", worker_load=load(running=2))
    assert chosen(policy, [Candidate(a, num_in_flight=3), Candidate(b, num_in_flight=0)], route()) == "b"
    assert chosen(policy, [Candidate(a, num_in_flight=2), Candidate(b, num_in_flight=2)], route()) == "a"
    assert Candidate(b, num_in_flight=1).num_active == 2 and Candidate(b, num_in_flight=5).num_active == 5


def test_policy_never_picks_dead_mismatched_or_unroutable_workers() -> None:
    policy = make_policy("least_load", TIMEOUT_S)
    busy = info("busy", worker_load=load(running=50))
    dead = info("dead", last_seen_s=96.9)
    other = info("other", model_id="n")
    prefill = info("prefill", role="prefill")
    candidates = [Candidate(w) for w in (dead, other, prefill, busy)]
    assert chosen(policy, candidates, route(model_id="m")) == "busy"
    assert chosen(policy, candidates, route(model_id="n")) == "other"
    assert chosen(policy, candidates, route(model_id="x")) is None
    assert chosen(policy, [Candidate(dead), Candidate(prefill)], route()) is None
    assert chosen(policy, [], route()) is None


worker_strategy = st.builds(
    info, worker_id=st.sampled_from("abcdefgh"), last_seen_s=st.floats(90.0, 100.0),
    model_id=st.sampled_from(["m", "n"]), role=st.sampled_from(["mixed", "prefill", "decode"]),
    worker_load=st.builds(load, st.integers(0, 5), st.integers(0, 5), st.integers(0, 100)))


@given(workers=st.lists(worker_strategy, max_size=8, unique_by=lambda w: w.worker_id),
       in_flight=st.lists(st.integers(0, 8), min_size=8, max_size=8),
       model_id=st.sampled_from([None, "m", "n"]))
def test_policy_property_choice_is_eligible_and_least_loaded(workers: list[WorkerInfo], in_flight: list[int],
                                                             model_id: str | None) -> None:
    candidates = [Candidate(w, n) for w, n in zip(workers, in_flight)]
    request = route(now_s=100.0, model_id=model_id)
    eligible = [c for c in candidates if 100.0 - c.worker.last_seen_s <= TIMEOUT_S and c.worker.role == "mixed"
                and model_id in (None, c.worker.model_id)]
    chosen_id = chosen(LeastLoadPolicy(TIMEOUT_S), candidates, request)
    if not eligible:
        assert chosen_id is None
        return
    best = min((c.num_active, -c.worker.load.num_free_pages, c.worker.worker_id) for c in eligible)
    assert chosen_id == best[2]
    assert LeastLoadPolicy(TIMEOUT_S).choose(candidates, request).reason is Reason.LOAD


# --- in-flight table --------------------------------------------------------------------------------------

def test_inflight_bookkeeping() -> None:
    table = InFlightTable()
    table.add("r1", "a", "ipc://t1")
    table.add("r2", "a", "ipc://t2")
    table.add("r3", "b", "ipc://t1")
    assert (len(table), table.count("a"), table.count("b"), table.count("c")) == (3, 2, 1, 0)
    table.add("r3", "a", "ipc://t1")  # routed again: moves
    assert (table.count("a"), table.count("b")) == (3, 0)
    assert table.pop("r2") == InFlight("r2", "a", "ipc://t2") and table.pop("r2") is None
    assert table.pop_worker("a") == [InFlight("r1", "a", "ipc://t1"), InFlight("r3", "a", "ipc://t1")]
    assert len(table) == 0 and table.pop_worker("a") == []
    table.check_invariants()


@given(st.lists(st.tuples(st.sampled_from(["add", "pop", "pop_worker"]), st.sampled_from("rstu"),
                          st.sampled_from("ab")), max_size=40))
def test_inflight_matches_a_dict_model(ops: list[tuple[str, str, str]]) -> None:
    table, model = InFlightTable(), {}
    for op, request_id, worker_id in ops:
        if op == "add":
            table.add(request_id, worker_id, "ipc://t")
            model[request_id] = worker_id
        elif op == "pop":
            entry = table.pop(request_id)
            assert (entry.worker_id if entry else None) == model.pop(request_id, None)
        else:
            popped = [e.request_id for e in table.pop_worker(worker_id)]
            assert popped == sorted(r for r, w in model.items() if w == worker_id)
            model = {r: w for r, w in model.items() if w != worker_id}
        table.check_invariants()
        assert len(table) == len(model)
        assert table.count("a") == sum(w == "a" for w in model.values())


# --- waiting queue ----------------------------------------------------------------------------------------

def test_waiting_queue_is_bounded_fifo_with_deadlines() -> None:
    queue = WaitingQueue(max_size=2, max_tokens=100)
    assert queue.push(tokenized("r1"), deadline_s=10.0) and queue.push(tokenized("r2"), deadline_s=5.0)
    assert not queue.push(tokenized("r3"), deadline_s=10.0)
    assert len(queue) == 2 and "r3" not in queue
    assert [w.request.request_id for w in queue.pop_expired(now_s=5.0)] == ["r2"]
    assert queue.push(tokenized("r3"), deadline_s=10.0)
    first = queue.pop()
    assert first.request.request_id == "r1"
    queue.push_front(first)
    assert queue.remove("r3") and not queue.remove("r3")
    assert queue.pop().request.request_id == "r1" and queue.pop() is None
    queue.check_invariants()


def prompt(request_id: str, num_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(request_id, list(range(num_tokens)), [], SamplingSpec(), "ipc://tok", 0.0)


def queued(queue: WaitingQueue) -> tuple[list[str], int]:
    queue.check_invariants()
    return [w.request.request_id for w in queue._items.values()], queue.num_tokens


def test_waiting_queue_refuses_a_push_at_either_bound_and_keeps_its_token_total() -> None:
    queue = WaitingQueue(max_size=3, max_tokens=100)
    assert queue.push(prompt("a", 40), 10.0) and queue.push(prompt("b", 50), 20.0)
    assert not queue.push(prompt("c", 11), 10.0)  # 101 tokens: over the token bound
    assert queued(queue) == (["a", "b"], 90)
    assert queue.push(prompt("c", 10), 30.0)  # exactly 100 tokens
    assert queued(queue) == (["a", "b", "c"], 100)
    assert queue.pop().request.request_id == "a"
    assert queued(queue) == (["b", "c"], 60)
    assert queue.push(prompt("d", 0), 40.0)
    assert not queue.push(prompt("e", 0), 40.0)  # 3 requests: over the count bound, though tokens are left
    assert queued(queue) == (["b", "c", "d"], 60)
    assert queue.remove("c") and not queue.remove("c")
    assert queued(queue) == (["b", "d"], 50)
    assert [w.request.request_id for w in queue.pop_expired(now_s=20.0)] == ["b"]
    assert queued(queue) == (["d"], 0)
    head = queue.pop()
    assert queued(queue) == ([], 0)
    queue.push_front(head)
    assert queue.push(prompt("f", 100), 50.0)
    first = queue.pop()
    assert queued(queue) == (["f"], 100) and first.request.request_id == "d"
    queue.push_front(first)  # back where it was, bounds not checked again
    assert queued(queue) == (["d", "f"], 100)


def test_waiting_queue_takes_one_overlong_prompt_only_when_empty_and_drops_a_refused_ids_old_copy() -> None:
    queue = WaitingQueue(max_size=4, max_tokens=100)
    assert queue.push(prompt("long", 150), 10.0)  # alone: taken, or it would be refused for ever
    assert not queue.push(prompt("short", 1), 10.0)
    assert queued(queue) == (["long"], 150)
    assert queue.pop().request.request_id == "long"
    assert queue.push(prompt("a", 60), 10.0) and queue.push(prompt("b", 30), 10.0)
    assert queue.push(prompt("a", 70), 10.0)  # the same id again: replaces its copy, at the back
    assert queued(queue) == (["b", "a"], 100)
    assert not queue.push(prompt("b", 31), 10.0)  # refused: its old copy is gone too (the caller answers 429)
    assert queued(queue) == (["a"], 70)
    assert not WaitingQueue(max_size=0, max_tokens=100).push(prompt("x", 1), 10.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "remove", "expire", "requeue"]),
                          st.sampled_from("abcdef"), st.integers(0, 60), st.integers(0, 9)), max_size=40))
def test_waiting_queue_matches_a_list_model(ops: list[tuple[str, str, int, int]]) -> None:
    queue, model = WaitingQueue(max_size=4, max_tokens=100), []  # model: [(request_id, num_tokens, deadline)]
    for op, request_id, num_tokens, when in ops:
        if op == "push":
            model = [m for m in model if m[0] != request_id]
            fits = len(model) < 4 and (not model or sum(m[1] for m in model) + num_tokens <= 100)
            assert queue.push(prompt(request_id, num_tokens), float(when)) == fits
            model += [(request_id, num_tokens, when)] if fits else []
        elif op == "pop":
            waiting = queue.pop()
            assert (waiting.request.request_id if waiting else None) == (model.pop(0)[0] if model else None)
        elif op == "remove":
            assert queue.remove(request_id) == any(m[0] == request_id for m in model)
            model = [m for m in model if m[0] != request_id]
        elif op == "expire":
            assert [w.request.request_id for w in queue.pop_expired(float(when))] == [
                m[0] for m in model if m[2] <= when]
            model = [m for m in model if m[2] > when]
        elif (waiting := queue.pop()) is not None:  # requeue: popped, not routable, put back
            queue.push_front(waiting)
        assert queued(queue) == ([m[0] for m in model], sum(m[1] for m in model))


def test_queue_deadline_is_the_sooner_of_the_wait_limit_and_the_requests_own_and_none_by_default() -> None:
    assert queue_deadline_s(100.0, 0.0, None) == math.inf  # the default: no wait limit, no deadline
    assert queue_deadline_s(100.0, 0.0, 150.0) == 150.0
    assert queue_deadline_s(100.0, 30.0, None) == 130.0
    assert queue_deadline_s(100.0, 30.0, 120.0) == 120.0
    assert queue_deadline_s(100.0, 30.0, 140.0) == 130.0
    queue = WaitingQueue(max_size=2, max_tokens=100)
    assert queue.push(prompt("r", 1), queue_deadline_s(100.0, 0.0, None))
    assert queue.pop_expired(now_s=1e12) == [] and len(queue) == 1


def test_scheduler_defaults_queue_a_burst_without_a_wait_limit_and_derive_the_worker_limit() -> None:
    config = SchedulerConfig()
    assert (config.max_queue_wait_s, config.max_requests_per_worker) == (0.0, 0)
    assert config.max_queue >= 5000 and config.max_queued_tokens >= 5000 * 1000
    assert (config.requests_per_worker(2), config.requests_per_worker(256)) == (4, 512)
    assert config.requests_per_worker(0) == 512  # a worker that reports no max_num_seqs
    assert SchedulerConfig(max_requests_per_worker=3).requests_per_worker(256) == 3
    with pytest.raises(ValueError):
        SchedulerConfig(max_queue_wait_s=-1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_queued_tokens=-1)


# --- cache_index sequencer --------------------------------------------------------------------------------

def batch(first_seq: int, events: list[KVEvent], incarnation: str = "i1", worker_id: str = "w") -> KVEventBatch:
    return KVEventBatch(worker_id, "ipc://w", incarnation, first_seq, events)


def stored(*hashes: int) -> BlocksStored:
    return BlocksStored(list(hashes), None, [0] * (4 * len(hashes)), 4)


def snapshot(next_seq: int, hashes: list[int], incarnation: str = "i1") -> CacheSnapshot:
    return CacheSnapshot("w", incarnation, next_seq, hashes)


def test_sequencer_applies_in_order_drops_duplicates_and_trims_overlap() -> None:
    seq = Sequencer()
    first = seq.on_batch(batch(0, [stored(1), stored(2)]), 0.0)
    assert (first.action, first.events, first.next_seq) == (Action.RESET_AND_APPLY, [stored(1), stored(2)], 2)
    nxt = seq.on_batch(batch(2, [BlocksRemoved([1])]), 0.0)
    assert (nxt.action, nxt.events, nxt.next_seq) == (Action.APPLY, [BlocksRemoved([1])], 3)
    assert seq.on_batch(batch(1, [stored(2), BlocksRemoved([1])]), 0.0).action is Action.DROP
    overlap = seq.on_batch(batch(2, [BlocksRemoved([1]), stored(7)]), 0.0)
    assert (overlap.action, overlap.events, overlap.next_seq) == (Action.APPLY, [stored(7)], 4)
    assert seq.on_batch(batch(4, []), 0.0).action is Action.DROP
    seq.check_invariants()


def test_sequencer_gap_buffers_until_snapshot_then_replays_from_next_seq() -> None:
    seq = Sequencer()
    seq.on_batch(batch(0, [stored(1)]), 0.0)
    assert seq.on_batch(batch(3, [stored(4)]), 1.0).action is Action.REQUEST_SNAPSHOT
    assert seq.on_batch(batch(4, [stored(5), stored(6)]), 1.1).action is Action.BUFFER
    assert seq.on_batch(batch(6, [AllBlocksCleared()]), 1.2).action is Action.BUFFER
    seq.check_invariants()
    assert seq.due_snapshot_requests(now_s=1.5, retry_s=1.0) == []
    assert seq.due_snapshot_requests(now_s=2.0, retry_s=1.0) == [("w", "ipc://w")]
    assert seq.due_snapshot_requests(now_s=2.5, retry_s=1.0) == []
    decision = seq.on_snapshot(snapshot(5, [1, 2, 4, 5]), 3.0)  # as of seq 5: batch 3 and half of 4 are in it
    assert decision.is_accepted and not decision.needs_snapshot
    assert (decision.events_after, decision.next_seq) == ([stored(6), AllBlocksCleared()], 7)
    assert seq.on_batch(batch(7, [stored(8)]), 3.1).next_seq == 8
    assert not seq.on_snapshot(snapshot(8, [8]), 3.2).is_accepted  # not awaited
    seq.check_invariants()


def test_sequencer_gap_inside_the_buffer_asks_again() -> None:
    seq = Sequencer()
    seq.on_batch(batch(0, [stored(1)]), 0.0)
    seq.on_batch(batch(2, [stored(3)]), 0.0)
    seq.on_batch(batch(5, [stored(6)]), 0.0)
    decision = seq.on_snapshot(snapshot(3, [1, 2, 3]), 1.0)
    assert (decision.is_accepted, decision.events_after, decision.needs_snapshot) == (True, [], True)
    assert seq.get("w").is_awaiting_snapshot and [b.first_seq for b in seq.get("w").buffered] == [5]
    assert seq.due_snapshot_requests(now_s=1.5, retry_s=1.0) == []  # just requested by the service
    final = seq.on_snapshot(snapshot(5, [1, 2, 3]), 2.0)
    assert (final.events_after, final.next_seq, final.needs_snapshot) == ([stored(6)], 6, False)
    seq.check_invariants()


def test_sequencer_restarts_and_retired_incarnations() -> None:
    seq = Sequencer()
    seq.on_batch(batch(0, [stored(1)], "i1"), 0.0)
    restart = seq.on_batch(batch(0, [stored(2)], "i2"), 1.0)
    assert (restart.action, restart.events, restart.next_seq) == (Action.RESET_AND_APPLY, [stored(2)], 1)
    assert seq.on_batch(batch(1, [stored(9)], "i1"), 1.1).action is Action.DROP  # a late straggler of i1
    assert seq.on_batch(batch(4, [stored(3)], "i3"), 2.0).action is Action.REQUEST_SNAPSHOT
    assert not seq.on_snapshot(snapshot(9, [9], "i1"), 2.1).is_accepted
    decision = seq.on_snapshot(snapshot(5, [3], "i3"), 2.2)
    assert (decision.is_accepted, decision.events_after, decision.next_seq) == (True, [], 5)
    seq.check_invariants()


def test_sequencer_unknown_worker_past_seq_zero_and_failed_writes_need_snapshots() -> None:
    seq = Sequencer()
    assert seq.on_batch(batch(7, [stored(1)]), 0.0).action is Action.REQUEST_SNAPSHOT
    seq.forget("w")
    seq.restore("w", "i1", 7, "ipc://w")
    assert seq.on_batch(batch(7, [stored(1)]), 0.0).action is Action.APPLY
    seq.mark_needs_snapshot("w")
    assert seq.on_batch(batch(8, [stored(2)]), 0.1).action is Action.BUFFER
    assert seq.due_snapshot_requests(now_s=0.2, retry_s=1.0) == [("w", "ipc://w")]
    seq.mark_needs_snapshot("nobody")
    seq.check_invariants()


def test_sequencer_buffer_overflow_drops_buffered_batches() -> None:
    seq = Sequencer(max_buffered_batches=2)
    seq.on_batch(batch(0, []), 0.0)
    for first_seq in (2, 3, 4):
        seq.on_batch(batch(first_seq, [stored(first_seq)]), 0.0)
    assert [b.first_seq for b in seq.get("w").buffered] == [4]
    decision = seq.on_snapshot(snapshot(3, [2]), 1.0)
    assert (decision.events_after, decision.needs_snapshot) == ([], True)  # 3 was dropped: gap at 4
    seq.check_invariants()


def apply_to(blocks: set[int], events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlocksStored):
            blocks.update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            blocks.difference_update(event.block_hashes)
        else:
            blocks.clear()


event_strategy = st.one_of(
    st.builds(lambda hs: BlocksStored(hs, None, [0] * (4 * len(hs)), 4), st.lists(st.integers(0, 9), max_size=3)),
    st.builds(BlocksRemoved, st.lists(st.integers(0, 9), max_size=3)),
    st.just(AllBlocksCleared()))


STEPS = ["next"] * 4 + ["drop", "repeat", "late", "snapshot"]


@settings(max_examples=300)
@given(batches=st.lists(st.lists(event_strategy, max_size=3), min_size=1, max_size=8),
       steps=st.lists(st.tuples(st.sampled_from(STEPS), st.integers(0, 8)), max_size=30))
def test_sequencer_keeps_the_index_exact_whenever_it_is_not_resyncing(
        batches: list[list[KVEvent]], steps: list[tuple[str, int]]) -> None:
    """A worker's batches go out in order; some are dropped, repeated or arrive late, and awaited snapshots
    (each exact as of some batch boundary) answer at random moments. Whenever the sequencer is not awaiting a
    snapshot, the index equals the worker's truth at the sequencer's next_seq."""
    truth_at, ends, truth = [set()], [0], set()
    for events in batches:
        for event in events:
            apply_to(truth, [event])
            truth_at.append(set(truth))
        ends.append(len(truth_at) - 1)
    seq, index, sent = Sequencer(), set(), 0  # batches[:sent] have been produced
    for step, k in steps:
        state = seq.get("w")
        if step == "snapshot" and state is not None and state.is_awaiting_snapshot:
            next_seq = ends[k % (sent + 1)]
            decision = seq.on_snapshot(snapshot(next_seq, sorted(truth_at[next_seq])), 0.0)
            index = set(truth_at[next_seq])
            apply_to(index, decision.events_after)
        elif step in ("next", "drop") and sent < len(batches) or step in ("repeat", "late") and sent:
            i = {"next": sent, "drop": sent, "repeat": sent - 1, "late": k % max(sent, 1)}[step]
            sent = max(sent, i + 1)
            if step != "drop":
                decision = seq.on_batch(batch(ends[i], batches[i]), 0.0)
                if decision.action is Action.RESET_AND_APPLY:
                    index.clear()
                apply_to(index, decision.events)
        seq.check_invariants()
        state = seq.get("w")
        if state is not None and not state.is_awaiting_snapshot:
            assert index == truth_at[state.next_seq]


def test_sequencer_resync_all_marks_every_worker_not_already_resyncing() -> None:
    seq = Sequencer()
    seq.on_batch(batch(0, [stored(1)], worker_id="a"), 0.0)
    seq.on_batch(batch(0, [stored(2)], worker_id="b"), 0.0)
    seq.on_batch(batch(5, [stored(3)], worker_id="c"), 0.0)  # already awaiting, requested at 0.0
    assert seq.resync_all() == ["a", "b"]
    assert sorted(seq.due_snapshot_requests(now_s=0.5, retry_s=1.0)) == [("a", "ipc://w"), ("b", "ipc://w")]
    assert seq.on_batch(batch(1, [stored(4)], worker_id="a"), 0.6).action is Action.BUFFER
    assert seq.resync_all() == []
    seq.check_invariants()
