"""The tokenizer's failover table (services/tokenizer/request_table.py): exact actions for each failover path, and
a hypothesis state machine driving random events, send failures and clock steps against its invariants."""
from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from services.tokenizer.request_table import (Action, Fail, LinkPhase, Phase, RequestTable, Send, gone_error,
                                              unreachable_error)
from shared.messages import (AbortRequest, AdoptRequest, GenerateError, SamplingSpec, StatusRequest,
                             TokenizedRequest)

TIMEOUT_S = 1.0
GIVE_UP_S = 4.0
REPLY_ADDR = "ipc://tokenizer"
WORKERS = ["w0", "w1", "w2"]


def request(request_id: str) -> TokenizedRequest:
    return TokenizedRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], block_hashes=[],
                            sampling=SamplingSpec(), reply_addr=REPLY_ADDR, arrival_s=0.0)


def worker_lost(request_id: str) -> GenerateError:
    return GenerateError(request_id, 503, "server_error", "worker died", worker_lost=True)


class Shell:
    """Executes actions as the service does; sends to a scheduler not in `connected` fail."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.connected = set(range(len(table.links)))
        self.sent: list[Send] = []
        self.failed: list[Fail] = []

    def run(self, actions: list[Action], now_s: float = 0.0) -> None:
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Fail):
                self.failed.append(action)
            elif not self.table.is_due(action):
                queue.extendleft(reversed(self.table.on_not_due(action)))
            elif action.link in self.connected:
                self.on_delivered(action)
                self.sent.append(action)
                self.table.on_sent(action)
            else:
                queue.extendleft(reversed(self.table.on_unreachable(action, now_s)))

    def on_delivered(self, action: Send) -> None:
        """Called before the table hears of a delivery: the state machine checks what the request had then."""

    def sent_of(self, kind: type) -> list[Send]:
        return [s for s in self.sent if isinstance(s.msg, kind)]


def make(num_links: int = 2, max_resends: int = 1) -> tuple[RequestTable, Shell]:
    table = RequestTable([f"ipc://s{i}" for i in range(num_links)], 0.0, REPLY_ADDR, TIMEOUT_S, GIVE_UP_S,
                         max_resends)
    return table, Shell(table)


def test_requests_go_round_robin_and_an_unreachable_scheduler_is_skipped() -> None:
    table, shell = make(num_links=3)
    shell.connected = {0, 2}
    for request_id in ("a", "b", "c"):
        shell.run(table.add(request(request_id)))
    assert [(s.link, s.msg.request_id) for s in shell.sent_of(TokenizedRequest)] == [(0, "a"), (2, "b"), (2, "c")]
    assert table.links[1].phase is LinkPhase.LOST and table.links[1].epoch == 1
    assert {r: e.link for r, e in table.requests.items()} == {"a": 0, "b": 2, "c": 2}
    table.check_invariants()


def test_with_no_scheduler_reachable_a_new_request_fails_with_503() -> None:
    table, shell = make()
    shell.connected = set()
    shell.run(table.add(request("a")))
    assert shell.failed == [Fail("a", unreachable_error("a"))]
    assert table.requests == {}


def test_a_silent_only_scheduler_keeps_its_requests_until_give_up() -> None:
    table, shell = make(num_links=1)
    shell.run(table.add(request("a")))
    shell.run(table.on_ping(TIMEOUT_S + 0.5))
    assert table.links[0].phase is LinkPhase.SILENT
    shell.run(table.on_ping(TIMEOUT_S + 0.5 + GIVE_UP_S - 0.1))
    assert shell.failed == [] and len(shell.sent_of(TokenizedRequest)) == 1
    shell.run(table.on_ping(TIMEOUT_S + 0.5 + GIVE_UP_S))
    assert shell.failed == [Fail("a", gone_error("a"))]  # no other live: the re-send finds none
    table.check_invariants()


def test_a_silent_scheduler_answering_as_the_same_incarnation_keeps_its_requests() -> None:
    table, shell = make(num_links=1)
    table.on_status(0, "inc-1", 2, 0.1)
    shell.run(table.add(request("a")))
    shell.run(table.on_ping(2.0))
    table.on_status(0, "inc-1", 2, 2.1)
    shell.run(table.on_ping(10.0 + GIVE_UP_S))  # answered at 2.1, then silent again since 10
    shell.run(table.on_ping(2.2))
    assert shell.failed == [] and len(shell.sent_of(TokenizedRequest)) == 1
    assert table.requests["a"].link == 0


def test_a_restarted_scheduler_gets_its_queued_request_once_more_and_its_routed_one_handed_over() -> None:
    table, shell = make(num_links=1)
    table.on_status(0, "inc-1", 2, 0.1)
    shell.run(table.add(request("queued")) + table.add(request("routed")))
    table.on_routed("routed", "w0", "")
    table.on_status(0, "inc-2", 2, 0.2)
    shell.run(table.on_ping(0.3))
    resent = shell.sent_of(TokenizedRequest)[2:]
    assert [(s.link, s.msg.request_id) for s in resent] == [(0, "queued")]
    assert [s.msg for s in shell.sent_of(AdoptRequest)] == [AdoptRequest("routed", "w0", REPLY_ADDR, "")]
    assert table.requests["queued"].num_resends == 1 and table.requests["routed"].num_resends == 0
    table.on_status(0, "inc-3", 2, 0.4)
    shell.run(table.on_ping(0.5))
    assert shell.failed == [Fail("queued", gone_error("queued"))]  # max_resends 1


def test_a_request_whose_worker_died_before_streaming_is_re_sent_after_it_never() -> None:
    table, shell = make()
    shell.run(table.add(request("a")) + table.add(request("b")))
    assert table.on_tokens("b", "w0") == (True, [])
    shell.run(table.on_error(worker_lost("a")))
    shell.run(table.on_error(worker_lost("b")))
    assert [s.msg.request_id for s in shell.sent_of(TokenizedRequest)] == ["a", "b", "a"]
    assert shell.failed == [Fail("b", worker_lost("b"))]
    shell.run(table.on_error(worker_lost("a")))
    assert shell.failed[-1] == Fail("a", worker_lost("a"))  # max_resends 1


def test_a_pd_request_is_not_re_sent_when_a_worker_dies() -> None:
    table, shell = make()
    shell.run(table.add(request("a")))
    table.on_routed("a", "d0", "p0")
    shell.run(table.on_error(worker_lost("a")))
    assert shell.failed == [Fail("a", worker_lost("a"))]


def test_tokens_from_a_stray_copy_are_refused_and_it_is_stopped_once() -> None:
    table, shell = make()
    shell.run(table.add(request("a")))
    table.on_routed("a", "w0", "")
    is_accepted, actions = table.on_tokens("a", "w1")
    shell.run(actions)
    assert not is_accepted
    assert [(s.link, s.msg) for s in shell.sent_of(AbortRequest)] == [(0, AbortRequest("a", "duplicate", "w1")),
                                                                      (1, AbortRequest("a", "duplicate", "w1"))]
    assert table.on_tokens("a", "w1") == (False, [])
    assert table.on_tokens("a", "w0") == (True, [])
    assert table.requests["a"].phase is Phase.CONFIRMED and table.requests["a"].request is None


def test_a_copy_routed_after_another_streamed_is_stopped_and_the_streaming_one_handed_over() -> None:
    table, shell = make()
    shell.run(table.add(request("a")))
    assert table.on_tokens("a", "w0") == (True, [])
    shell.run(table.on_routed("a", "w1", ""))
    assert [s.msg for s in shell.sent_of(AbortRequest)] == [AbortRequest("a", "duplicate", "w1")] * 2
    assert [s.msg for s in shell.sent_of(AdoptRequest)] == []  # both schedulers speak protocol 1
    table.on_status(0, "i", 2, 0.1)
    table.on_status(1, "i", 2, 0.1)
    shell.run(table.on_routed("a", "w2", ""))
    assert [(s.link, s.msg) for s in shell.sent_of(AdoptRequest)] == [(0, AdoptRequest("a", "w0", REPLY_ADDR))]


def test_a_handed_off_pd_request_is_adopted_without_its_prefill_worker() -> None:
    table, shell = make()
    for index in (0, 1):
        table.on_status(index, "i", 2, 0.1)
    shell.run(table.add(request("a")) + table.add(request("x")) + table.add(request("b")))
    assert table.requests["a"].link == table.requests["b"].link == 0
    table.on_routed("a", "d0", "p0")
    table.on_routed("b", "d0", "p0")
    table.on_tokens("a", "d0")
    table.on_tokens("b", "p0")
    assert table.requests["a"].phase is Phase.HANDED_OFF and table.requests["b"].phase is Phase.CONFIRMED
    shell.connected = {1}
    shell.run(table.on_unreachable(Send(0, StatusRequest()), 0.2))
    shell.run(table.on_ping(0.3))
    assert [s.msg for s in shell.sent_of(AdoptRequest)] == [AdoptRequest("a", "d0", REPLY_ADDR, ""),
                                                                  AdoptRequest("b", "d0", REPLY_ADDR, "p0")]


def test_unknown_tokens_are_stopped_unless_their_abort_was_sent() -> None:
    table, shell = make()
    shell.run(table.on_unknown_tokens("x", "w0"))
    assert [s.msg for s in shell.sent_of(AbortRequest)] == [AbortRequest("x", "unknown", "w0")] * 2
    shell.run(table.add(request("a")))
    table.on_tokens("a", "w0")
    shell.run(table.forget("a", "stop"))
    assert table.on_unknown_tokens("a", "w0") == []
    assert shell.sent_of(AbortRequest)[-1].msg == AbortRequest("a", "stop", "w0")


class TableMachine(RuleBasedStateMachine):
    """Random requests, routes, tokens, errors, aborts, pings, answers and disconnects."""

    @initialize(num_links=st.integers(1, 3), max_resends=st.integers(0, 2))
    def setup(self, num_links: int, max_resends: int) -> None:
        self.table, self.shell = make(num_links, max_resends)
        self.shell.on_delivered = self.on_delivered
        self.now_s = 0.0
        self.next_id = 0
        self.in_flight: set[str] = set()  # as the service's own request dict
        self.ended: Counter[str] = Counter()
        self.num_request_sends: Counter[str] = Counter()
        self.may_move: set[str] = set()  # requests whose current event may send them while their holder is current
        self.incarnations = ["a"] * num_links  # what each scheduler answers as
        self.holders: dict[str, set[int]] = {}  # schedulers that really hold each request (never lost since)

    def on_delivered(self, action: Send) -> None:
        if not isinstance(action.msg, (TokenizedRequest, AdoptRequest)):
            return
        if isinstance(action.msg, TokenizedRequest):
            self.num_request_sends[action.request_id] += 1
        self.forget_lost_holders()
        holders = self.holders.setdefault(action.request_id, set())
        # NOTE: never on two schedulers at once while the first was never lost nor restarted: only a request whose
        # worker died, or whose stray copy its holder routed, moves then.
        # A request is not sent again to a scheduler that still holds it (it would route it twice).
        others = holders if isinstance(action.msg, TokenizedRequest) else holders - {action.link}
        assert not others or action.request_id in self.may_move, (action, holders)
        holders.add(action.link)

    def forget_lost_holders(self) -> None:
        lost = {i for i, link in enumerate(self.table.links) if link.phase is LinkPhase.LOST}
        for holders in self.holders.values():
            holders -= lost

    def run(self, actions: list[Action]) -> None:
        num_failed = len(self.shell.failed)
        self.shell.run(actions, self.now_s)
        self.forget_lost_holders()
        for fail in self.shell.failed[num_failed:]:
            assert fail.request_id in self.in_flight, fail
            self.end(fail.request_id)
        self.may_move.clear()

    def end(self, request_id: str) -> None:
        self.in_flight.discard(request_id)
        self.ended[request_id] += 1

    def pick(self, data: st.DataObject) -> str:
        known = sorted(self.in_flight | set(self.ended)) or ["none"]
        return data.draw(st.sampled_from(known))

    @rule()
    def add(self) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.in_flight.add(request_id)
        self.run(self.table.add(request(request_id)))

    @rule(data=st.data(), worker=st.sampled_from(WORKERS), prefill=st.sampled_from(["", "p0"]))
    def routed(self, data: st.DataObject, worker: str, prefill: str) -> None:
        request_id = self.pick(data)
        self.may_move.add(request_id)
        self.run(self.table.on_routed(request_id, worker, prefill))

    @rule(data=st.data(), worker=st.sampled_from([*WORKERS, "p0"]))
    def tokens(self, data: st.DataObject, worker: str) -> None:
        request_id = self.pick(data)
        if request_id in self.in_flight:
            _is_accepted, actions = self.table.on_tokens(request_id, worker)
        else:
            actions = self.table.on_unknown_tokens(request_id, worker)
        self.run(actions)

    @rule(data=st.data(), is_worker_done=st.booleans())
    def finish(self, data: st.DataObject, is_worker_done: bool) -> None:
        request_id = self.pick(data)
        if request_id in self.in_flight:
            self.end(request_id)
            self.run(self.table.forget(request_id, None if is_worker_done else "stop"))

    @rule(data=st.data())
    def gateway_abort(self, data: st.DataObject) -> None:
        request_id = self.pick(data)
        if request_id in self.in_flight:
            self.end(request_id)
        self.run(self.table.forget(request_id, "client"))

    @rule(data=st.data(), is_worker_lost=st.booleans())
    def error(self, data: st.DataObject, is_worker_lost: bool) -> None:
        request_id = self.pick(data)
        if request_id in self.in_flight:
            self.may_move.add(request_id)
            if is_worker_lost:
                self.holders.pop(request_id, None)  # its scheduler dropped it
            self.run(self.table.on_error(GenerateError(request_id, 503, "server_error", "x",
                                                       worker_lost=is_worker_lost)))

    @rule(step_s=st.sampled_from([0.1, 0.5, 1.5, 3.0, 4.0]))
    def ping(self, step_s: float) -> None:
        self.now_s += step_s
        links = self.table.links
        is_timed_out = [link.phase is LinkPhase.LIVE and self.now_s - link.last_seen_s > TIMEOUT_S for link in links]
        has_live = any(link.phase is LinkPhase.LIVE and not out for link, out in zip(links, is_timed_out))
        since_s = [self.now_s if out else link.silent_since_s for link, out in zip(links, is_timed_out)]
        silent_since = {r: since_s[e.link] for r, e in self.table.requests.items()
                        if e.link is not None and since_s[e.link] is not None and links[e.link].epoch == e.link_epoch}
        num_failed = len(self.shell.failed)
        self.run(self.table.on_ping(self.now_s))
        phases = {link.phase for link in links}
        assert not {LinkPhase.LIVE, LinkPhase.SILENT} <= phases, links  # nothing waits for a silent one then
        for fail in self.shell.failed[num_failed:]:
            since_s = silent_since.get(fail.request_id)
            # NOTE: a request of a silent scheduler fails only once it was given up on
            assert since_s is None or has_live or self.now_s - since_s >= GIVE_UP_S, (fail, since_s)

    @rule(data=st.data(), version=st.sampled_from([1, 2]))
    def answer(self, data: st.DataObject, version: int) -> None:
        index = data.draw(st.integers(0, len(self.table.links) - 1))
        if index not in self.shell.connected:
            return
        if self.table.links[index].incarnation not in ("", self.incarnations[index]):
            # NOTE: it forgot its requests when it restarted, but the table learns it only now: one sent to it in
            # between is re-sent to it (a window in which a request can run twice).
            for holders in self.holders.values():
                holders.discard(index)
        self.table.on_status(index, self.incarnations[index], version, self.now_s)

    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.table.links) - 1))
        self.incarnations[index] += "'"

    @rule(data=st.data())
    def toggle_connected(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.table.links) - 1))
        self.shell.connected ^= {index}

    @invariant()
    def table_is_consistent(self) -> None:
        if not hasattr(self, "table"):
            return
        self.table.check_invariants()
        assert set(self.table.requests) == self.in_flight
        assert all(count == 1 for count in self.ended.values()), self.ended
        limit = 1 + self.table.max_resends
        assert all(count <= limit for count in self.num_request_sends.values()), self.num_request_sends


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)


@pytest.mark.parametrize("phase", list(Phase))
def test_every_phase_is_reached(phase: Phase) -> None:
    table, shell = make()
    for index in (0, 1):
        table.on_status(index, "i", 2, 0.1)
    shell.run(table.add(request("a")))
    steps = {Phase.QUEUED: [], Phase.ROUTED: [("r", "w0", "p0")], Phase.STREAMING: [("t", "w0")],
             Phase.CONFIRMED: [("r", "w0", "p0"), ("t", "p0")],
             Phase.HANDED_OFF: [("r", "w0", "p0"), ("t", "w0")]}[phase]
    for step in steps:
        if step[0] == "r":
            table.on_routed("a", step[1], step[2])
        else:
            table.on_tokens("a", step[1])
    assert table.requests["a"].phase is phase
    table.check_invariants()
