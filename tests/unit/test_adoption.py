"""The scheduler's handover core (services/scheduler/adoption.py): exact decisions for AdoptRequest and for adopted
requests whose workers never show up, and a hypothesis state machine against a simple model."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from services.scheduler.adoption import Adoption, Handovers

MEMORY_S = 10.0
CONFIRM_S = 3.0
REQUESTS = ["a", "b", "c"]
WORKERS = ["w0", "w1", "p0"]


def test_a_request_that_ended_or_was_aborted_before_its_handover_is_not_taken_on() -> None:
    handovers = Handovers(MEMORY_S, CONFIRM_S)
    handovers.note_finish("a", 0.0)
    handovers.note_abort("b", 0.0)
    assert handovers.on_adopt("a", ["w0"], {"w0"}, 1.0) is Adoption.ENDED
    assert handovers.on_adopt("b", ["w0"], {"w0"}, 1.0) is Adoption.ABORTED
    assert handovers.on_adopt("a", ["w0"], {"w0"}, 2.0) is Adoption.TAKE  # each is remembered for one handover
    handovers.note_abort("c", 0.0)
    assert handovers.on_adopt("c", ["w0"], {"w0"}, MEMORY_S + 0.1) is Adoption.TAKE  # forgotten after memory_s


def test_a_finish_wins_over_an_abort() -> None:
    handovers = Handovers(MEMORY_S, CONFIRM_S)
    handovers.note_abort("a", 0.0)
    handovers.note_finish("a", 0.0)
    assert handovers.on_adopt("a", ["w0"], set(), 1.0) is Adoption.ENDED
    assert handovers.on_adopt("a", ["w0"], {"w0"}, 1.0) is Adoption.ABORTED


def test_an_adopted_request_on_an_unknown_worker_fails_after_the_confirm_timeout() -> None:
    handovers = Handovers(MEMORY_S, CONFIRM_S)
    legs = {"a": ["w0", "p0"], "b": ["w1"]}
    assert handovers.on_adopt("a", legs["a"], {"w0"}, 1.0) is Adoption.TAKE
    assert handovers.on_adopt("b", legs["b"], set(), 1.0) is Adoption.TAKE
    assert handovers.is_unconfirmed("a") and handovers.is_unconfirmed("b")
    assert handovers.due_failures(1.0 + CONFIRM_S - 0.01, legs.get, {"w0", "w1"}) == []
    assert not handovers.is_unconfirmed("b")  # its worker showed up
    assert handovers.due_failures(1.0 + CONFIRM_S, legs.get, {"w0", "w1"}) == ["a"]
    assert not handovers.is_unconfirmed("a")
    assert handovers.due_failures(100.0, legs.get, set()) == []


def test_an_adopted_request_that_ended_is_forgotten() -> None:
    handovers = Handovers(MEMORY_S, CONFIRM_S)
    handovers.on_adopt("a", ["w0"], set(), 0.0)
    assert handovers.due_failures(CONFIRM_S, {}.get, set()) == []
    assert not handovers.is_unconfirmed("a")


def test_nothing_is_remembered_with_a_memory_of_zero() -> None:
    handovers = Handovers(0.0, CONFIRM_S)
    handovers.note_abort("a", 0.0)
    handovers.note_finish("b", 0.0)
    assert handovers.on_adopt("a", [], set(), 0.0) is Adoption.TAKE
    assert handovers.on_adopt("b", [], set(), 0.0) is Adoption.TAKE


class HandoverMachine(RuleBasedStateMachine):
    """Random aborts, ends, handovers, heartbeats and ticks, against a model of what each should decide."""

    @initialize()
    def setup(self) -> None:
        self.handovers = Handovers(MEMORY_S, CONFIRM_S)
        self.now_s = 0.0
        self.known: set[str] = set()
        self.in_flight: dict[str, list[str]] = {}  # the scheduler's in-flight legs
        self.aborted_s: dict[str, float] = {}  # model: last unknown abort time
        self.finished_s: dict[str, float] = {}
        self.adopted_s: dict[str, float] = {}  # model: adopted with an unknown worker, at

    def is_remembered(self, noted: dict[str, float], request_id: str) -> bool:
        at_s = noted.pop(request_id, None)
        return at_s is not None and at_s + MEMORY_S >= self.now_s

    @rule(request_id=st.sampled_from(REQUESTS))
    def abort_unknown(self, request_id: str) -> None:
        if request_id not in self.in_flight:
            self.handovers.note_abort(request_id, self.now_s)
            self.aborted_s.pop(request_id, None)
            self.aborted_s[request_id] = self.now_s

    @rule(request_id=st.sampled_from(REQUESTS))
    def finish(self, request_id: str) -> None:
        if self.in_flight.pop(request_id, None) is None:
            self.handovers.note_finish(request_id, self.now_s)
            self.finished_s[request_id] = self.now_s

    @rule(request_id=st.sampled_from(REQUESTS), legs=st.lists(st.sampled_from(WORKERS), min_size=1, max_size=2,
                                                                unique=True))
    def adopt(self, request_id: str, legs: list[str]) -> None:
        decision = self.handovers.on_adopt(request_id, legs, self.known, self.now_s)
        is_ended = self.is_remembered(self.finished_s, request_id)
        is_aborted = not is_ended and self.is_remembered(self.aborted_s, request_id)
        expected = Adoption.ENDED if is_ended else Adoption.ABORTED if is_aborted else Adoption.TAKE
        assert decision is expected
        if decision is Adoption.TAKE:
            self.in_flight[request_id] = legs
            if any(w not in self.known for w in legs):
                self.adopted_s[request_id] = self.now_s
            assert self.handovers.is_unconfirmed(request_id) == (request_id in self.adopted_s)

    @rule(worker_id=st.sampled_from(WORKERS))
    def heartbeat(self, worker_id: str) -> None:
        self.known.add(worker_id)

    @rule(worker_id=st.sampled_from(WORKERS))
    def worker_gone(self, worker_id: str) -> None:
        self.known.discard(worker_id)
        for request_id in [r for r, legs in self.in_flight.items() if worker_id in legs]:
            del self.in_flight[request_id]

    @rule(step_s=st.sampled_from([0.5, 1.0, 2.9, 3.0, 5.0, 11.0]))
    def tick(self, step_s: float) -> None:
        self.now_s += step_s
        self.handovers.expire(self.now_s)
        due = self.handovers.due_failures(self.now_s, self.in_flight.get, self.known)
        expected = []
        for request_id, at_s in list(self.adopted_s.items()):
            legs = self.in_flight.get(request_id)
            if legs is None or all(w in self.known for w in legs):
                del self.adopted_s[request_id]
            elif self.now_s >= at_s + CONFIRM_S:
                del self.adopted_s[request_id]
                expected.append(request_id)
        assert sorted(due) == sorted(expected)
        for request_id in due:
            del self.in_flight[request_id]  # failed with 503 worker_lost
        for noted in (self.aborted_s, self.finished_s):
            for request_id in [r for r, at_s in noted.items() if at_s + MEMORY_S < self.now_s]:
                del noted[request_id]

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "handovers"):
            self.handovers.check_invariants(self.now_s)
            assert all(self.handovers.is_unconfirmed(r) == (r in self.adopted_s) for r in REQUESTS)


TestHandoverMachine = HandoverMachine.TestCase
TestHandoverMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
