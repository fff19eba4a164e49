"""The tokenizer's failover table: which scheduler holds each request, and when a request is re-sent, handed over
(AdoptRequest), its stray copy stopped or it is failed (pure: no I/O, times passed in; the service sends)."""
from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import structlog

from shared.messages import AbortRequest, AdoptRequest, GenerateError, StatusRequest, TokenizedRequest

log = structlog.get_logger("services.tokenizer.service")

MAX_REMEMBERED_ABORTS = 65_536
SILENT = "stopped answering"  # the reason a scheduler that is still connected is lost
UNREACHABLE = "unreachable"  # a send to it failed at once: its socket is not connected


class LinkPhase(enum.Enum):
    LIVE = "live"      # answers pings: takes new requests and handovers
    SILENT = "silent"  # stopped answering but still connected: its requests wait for it until it is given up
    LOST = "lost"      # unreachable, given up, or not up yet: it comes back by answering a ping


@dataclass
class Link:
    """One scheduler as this tokenizer sees it (the service keeps its socket at the same index)."""

    addr: str
    last_seen_s: float  # monotonic: its last StatusReply (or start-up)
    phase: LinkPhase = LinkPhase.LIVE
    epoch: int = 0  # one more at each loss, give-up or restart: requests sent before then are orphans
    silent_since_s: float | None = None  # set while SILENT
    has_answered: bool = False
    incarnation: str = ""
    version: int = 1  # its protocol version: AdoptRequest needs 2


class Phase(enum.Enum):
    QUEUED = "queued"          # sent, no worker known, nothing streamed: re-sent if its scheduler is gone
    ROUTED = "routed"          # RequestRouted named its worker, nothing streamed: handed over if its scheduler is gone
    STREAMING = "streaming"    # a worker streamed before any RequestRouted: tokens from any worker are taken
    CONFIRMED = "confirmed"    # streaming and routed: tokens from a worker not named are a stray copy's
    HANDED_OFF = "handed_off"  # PD: its decode worker has streamed, so the prefill leg is closed


HAS_OUTPUT = (Phase.STREAMING, Phase.CONFIRMED, Phase.HANDED_OFF)  # never re-sent
IS_ROUTED = (Phase.ROUTED, Phase.CONFIRMED, Phase.HANDED_OFF)


@dataclass(frozen=True)
class Send:
    """Send msg to the scheduler at index link; then report on_sent, or on_unreachable when the send fails."""

    link: int
    msg: Any  # TokenizedRequest | AdoptRequest | AbortRequest | StatusRequest
    request_id: str = ""  # set for a request or handover: a failed send is tried on the next live scheduler


@dataclass(frozen=True)
class Fail:
    """Answer the request's gateway with error; the table has forgotten the request."""

    request_id: str
    error: GenerateError


Action = Send | Fail


@dataclass
class Pending:
    """A request or handover being sent: the live schedulers left to try, and what to do when none takes it."""

    msg: TokenizedRequest | AdoptRequest
    candidates: list[int]
    fallback: GenerateError | None  # None: a handover; the request streams on unheld
    note: str
    note_fields: dict[str, Any]


@dataclass
class Entry:
    """What the table knows of one request between its send and its end."""

    request_id: str
    request: TokenizedRequest | None  # kept until a token comes, to re-send it
    phase: Phase = Phase.QUEUED
    link: int | None = None  # the scheduler that has it (None: not sent yet, or none took its handover)
    link_epoch: int = 0  # that scheduler's epoch when it got the request
    worker_id: str = ""  # where it runs: from RequestRouted or its first tokens ("" while QUEUED)
    prefill_worker_id: str = ""  # PD: its prefill worker, from RequestRouted
    num_resends: int = 0
    refused_workers: set[str] = field(default_factory=set)  # workers running a stray copy, told to stop it
    pending: Pending | None = None


def gone_error(request_id: str) -> GenerateError:
    return GenerateError(request_id, 503, "server_error", "the scheduler holding the request is gone and it could "
                         "not be re-sent (no other is live, or it was re-sent max_resends times)", retry_after_s=1.0)


def unreachable_error(request_id: str) -> GenerateError:
    return GenerateError(request_id, 503, "server_error", "no scheduler is reachable; retry shortly",
                         retry_after_s=1.0)


class RequestTable:
    """Requests in flight and the schedulers holding them. Events in (sent, routed, tokens, error, ping, status,
    send results), actions out; the service executes each action in order and reports each send's result."""

    def __init__(self, addrs: list[str], now_s: float, reply_addr: str, timeout_s: float, give_up_s: float,
                 max_resends: int) -> None:
        if not addrs:
            raise ValueError("scheduler_addrs is empty")
        self.links = [Link(addr, now_s) for addr in addrs]
        self.reply_addr = reply_addr
        self.timeout_s, self.give_up_s, self.max_resends = timeout_s, give_up_s, max_resends
        self.requests: dict[str, Entry] = {}
        self._next_link = 0
        self._aborted: OrderedDict[str, None] = OrderedDict()  # recent aborts sent: their late tokens are expected

    # requests

    def add(self, request: TokenizedRequest) -> list[Action]:
        """A new request: send it to the next live scheduler, or fail it with 503."""
        entry = self.requests[request.request_id] = Entry(request.request_id, request)
        return self._send_request(entry, unreachable_error(request.request_id), "", {})

    def forget(self, request_id: str, abort_reason: str | None) -> list[Action]:
        """The request ended here (finished, failed or aborted); with abort_reason, tell the schedulers to stop it."""
        entry = self.requests.pop(request_id, None)
        if abort_reason is None:
            return []
        return self._abort_everywhere(AbortRequest(request_id, abort_reason, entry.worker_id if entry else ""))

    def on_routed(self, request_id: str, worker_id: str, prefill_worker_id: str) -> list[Action]:
        entry = self.requests.get(request_id)
        if entry is None:
            return []
        if entry.phase in HAS_OUTPUT and entry.worker_id not in (worker_id, prefill_worker_id):
            # A stray copy of the re-sent request streamed first: it stays; the copy just routed is stopped.
            entry.refused_workers.add(worker_id)
            actions = self._abort_everywhere(AbortRequest(request_id, "duplicate", worker_id))
            if entry.phase is Phase.STREAMING:
                entry.phase = Phase.CONFIRMED
            return actions + self._adopt(entry)
        entry.worker_id, entry.prefill_worker_id = worker_id, prefill_worker_id
        entry.phase = {Phase.QUEUED: Phase.ROUTED, Phase.STREAMING: Phase.CONFIRMED}.get(entry.phase, entry.phase)
        return []

    def on_tokens(self, request_id: str, worker_id: str) -> tuple[bool, list[Action]]:
        """Tokens for a request held here: whether they count (False: a stray copy's, which is told to stop)."""
        entry = self.requests.get(request_id)
        if entry is None:
            return False, []
        if entry.phase is Phase.QUEUED:
            entry.worker_id = worker_id  # before RequestRouted, or from a scheduler that does not send it
        elif entry.phase in IS_ROUTED and worker_id not in (entry.worker_id, entry.prefill_worker_id):
            if worker_id in entry.refused_workers:
                return False, []
            entry.refused_workers.add(worker_id)
            log.warning("tokens from a stray copy; stopping it", request_id=request_id, worker_id=worker_id,
                        expected_worker_id=entry.worker_id)
            return False, self._abort_everywhere(AbortRequest(request_id, "duplicate", worker_id))
        if worker_id == entry.worker_id and entry.prefill_worker_id not in ("", worker_id):
            entry.phase = Phase.HANDED_OFF
        elif entry.phase in (Phase.QUEUED, Phase.ROUTED):
            entry.phase = Phase.STREAMING if entry.phase is Phase.QUEUED else Phase.CONFIRMED
        entry.request = None  # never re-sent from now on
        return True, []

    def on_unknown_tokens(self, request_id: str, worker_id: str) -> list[Action]:
        """Unfinished tokens for a request not held here: stop it, unless its abort was sent already."""
        if request_id in self._aborted:
            return []
        # NOTE: nobody reads these tokens (a copy routed twice, or a request of this tokenizer's last run)
        log.info("tokens for a request not held here; stopping it", request_id=request_id, worker_id=worker_id)
        return self._abort_everywhere(AbortRequest(request_id, "unknown", worker_id))

    def on_error(self, err: GenerateError) -> list[Action]:
        """A worker or scheduler failed the request: re-send it if its worker died before it streamed, else fail."""
        entry = self.requests.get(err.request_id)
        # NOTE: a PD request's other leg was told to abort it; a re-sent copy could meet that abort there.
        if entry is not None and err.worker_lost and not entry.prefill_worker_id and self._can_resend(entry):
            return self._resend(entry, err.message, err)
        self.requests.pop(err.request_id, None)
        return [Fail(err.request_id, err)]

    # schedulers

    def on_ping(self, now_s: float) -> list[Action]:
        """Lose the live schedulers that stopped answering, give up on silent ones, re-home the requests of lost
        ones, and ping every scheduler (a lost one comes back by answering)."""
        for index, link in enumerate(self.links):
            if link.phase is LinkPhase.LIVE and now_s - link.last_seen_s > self.timeout_s:
                self._lose(index, SILENT, now_s)
        self._settle_silent(now_s)
        # NOTE: re-homed here, not at the loss: RequestRouted sent just before a kill is read by now.
        return self._rehome_orphans() + [Send(index, StatusRequest()) for index in range(len(self.links))]

    def on_status(self, index: int, incarnation: str, version: int, now_s: float) -> None:
        link = self.links[index]
        was_silent = link.phase is LinkPhase.SILENT
        if link.incarnation and incarnation != link.incarnation and link.phase is not LinkPhase.LOST:
            log.warning("scheduler restarted; its requests are handed over or re-sent", addr=link.addr)
            link.epoch += 1
        elif was_silent and (num_kept := self._num_requests(index)):
            # NOTE: same incarnation: it still holds what it had (their epoch is still its own); a re-send would
            # make it route a request twice.
            log.info("scheduler answers again; its requests were kept", addr=link.addr, num_requests=num_kept)
        link.last_seen_s, link.silent_since_s = now_s, None
        link.has_answered, link.incarnation, link.version = True, incarnation, version
        if link.phase is not LinkPhase.LIVE:
            link.phase = LinkPhase.LIVE
            log.info("scheduler live", addr=link.addr, incarnation=incarnation or None)

    # send results

    def is_due(self, action: Send) -> bool:
        """Whether action is still to be sent (False: its scheduler was lost meanwhile, or the request ended)."""
        if isinstance(action.msg, StatusRequest):
            return True
        if isinstance(action.msg, AbortRequest):
            return self.links[action.link].phase is not LinkPhase.LOST
        entry = self.requests.get(action.request_id)
        return (entry is not None and entry.pending is not None and entry.pending.msg is action.msg
                and self._can_take(action.link, action.msg))

    def on_not_due(self, action: Send) -> list[Action]:
        """action was not sent: try its request on the next live scheduler."""
        entry = self.requests.get(action.request_id) if action.request_id else None
        if entry is None or entry.pending is None or entry.pending.msg is not action.msg:
            return []
        return self._try_next(entry)

    def on_sent(self, action: Send) -> None:
        entry = self.requests.get(action.request_id) if action.request_id else None
        if entry is None or entry.pending is None or entry.pending.msg is not action.msg:
            return
        pending, entry.pending = entry.pending, None
        entry.link, entry.link_epoch = action.link, self.links[action.link].epoch
        if pending.note:
            log.info(pending.note, request_id=entry.request_id, addr=self.links[action.link].addr,
                     **pending.note_fields)

    def on_unreachable(self, action: Send, now_s: float) -> list[Action]:
        """The send failed at once (not connected, or full): that scheduler is lost; a request goes to the next."""
        self._lose(action.link, UNREACHABLE, now_s)
        return self.on_not_due(action)

    # internals

    def _lose(self, index: int, reason: str, now_s: float) -> None:
        """No new requests go to the scheduler. One lost for silence keeps its requests until _settle_silent gives
        up on it; one that cannot be reached is gone at once."""
        link = self.links[index]
        if link.phase is not LinkPhase.LIVE:
            if link.phase is LinkPhase.SILENT and reason != SILENT:
                self._give_up(index, reason)
            return
        num_requests = self._num_requests(index)
        if link.has_answered or num_requests:
            log.warning("scheduler lost", addr=link.addr, reason=reason, num_requests=num_requests)
        else:
            log.info("scheduler not up yet", addr=link.addr, reason=reason)
        if reason == SILENT:
            link.phase, link.silent_since_s = LinkPhase.SILENT, now_s
        else:
            link.phase = LinkPhase.LOST
            link.epoch += 1

    def _settle_silent(self, now_s: float) -> None:
        """Give up on each silent scheduler whose requests another live one can take, or that stayed silent for
        give_up_s: its requests become orphans. Until then they wait for it, neither re-sent nor failed (it may
        only be busy, and a re-sent request would be routed twice)."""
        has_live = any(link.phase is LinkPhase.LIVE for link in self.links)
        for index, link in enumerate(self.links):
            if link.silent_since_s is None:
                continue
            if has_live:
                self._give_up(index, "another scheduler is live")
            elif now_s - link.silent_since_s >= self.give_up_s:
                self._give_up(index, f"silent for scheduler_give_up_s ({self.give_up_s} s)")

    def _give_up(self, index: int, reason: str) -> None:
        link = self.links[index]
        link.phase, link.silent_since_s = LinkPhase.LOST, None
        link.epoch += 1
        if num_requests := self._num_requests(index):
            log.warning("silent scheduler given up", addr=link.addr, reason=reason, num_requests=num_requests)

    def _num_requests(self, index: int) -> int:
        return sum(entry.link == index for entry in self.requests.values())

    def _is_orphan(self, entry: Entry) -> bool:
        if entry.link is None:
            return bool(entry.worker_id)  # runs on a worker that no scheduler took over
        return entry.link_epoch != self.links[entry.link].epoch

    def _rehome_orphans(self) -> list[Action]:
        """Requests of a lost or restarted scheduler, and those running on a worker that no scheduler took over:
        hand each running one over to a live scheduler; re-send the others, or fail them with 503."""
        actions: list[Action] = []
        for entry in [e for e in self.requests.values() if self._is_orphan(e)]:
            entry.link = None
            if entry.worker_id:
                actions += self._adopt(entry)
            elif self._can_resend(entry):
                actions += self._resend(entry, "its scheduler is gone", gone_error(entry.request_id))
            else:
                del self.requests[entry.request_id]
                actions.append(Fail(entry.request_id, gone_error(entry.request_id)))
        return actions

    def _adopt(self, entry: Entry) -> list[Action]:
        """Hand a request that runs on a worker to a live scheduler; with none, it streams on unheld (and is
        handed over at a later ping)."""
        prefill_worker_id = "" if entry.phase is Phase.HANDED_OFF else entry.prefill_worker_id
        adopt = AdoptRequest(entry.request_id, entry.worker_id, self.reply_addr, prefill_worker_id)
        entry.pending = Pending(adopt, self._live_links(), None, "request handed over",
                                {"worker_id": entry.worker_id})
        return self._try_next(entry)

    def _can_resend(self, entry: Entry) -> bool:
        return entry.request is not None and entry.num_resends < self.max_resends

    def _resend(self, entry: Entry, reason: str, fallback: GenerateError) -> list[Action]:
        """Send a request that has streamed nothing to a live scheduler again (the caller checked _can_resend)."""
        entry.num_resends += 1
        entry.worker_id, entry.prefill_worker_id, entry.phase = "", "", Phase.QUEUED
        return self._send_request(entry, fallback, "request re-sent",
                                  {"reason": reason, "num_resends": entry.num_resends})

    def _send_request(self, entry: Entry, fallback: GenerateError, note: str, fields: dict[str, Any]) -> list[Action]:
        assert entry.request is not None
        entry.pending = Pending(entry.request, self._live_links(), fallback, note, fields)
        return self._try_next(entry)

    def _try_next(self, entry: Entry) -> list[Action]:
        """Send the pending message to the next candidate that can take it; when none is left, its fallback."""
        pending = entry.pending
        assert pending is not None
        while pending.candidates:
            index = pending.candidates.pop(0)
            if self._can_take(index, pending.msg):
                return [Send(index, pending.msg, entry.request_id)]
        entry.pending = None
        if pending.fallback is None:
            return []
        del self.requests[entry.request_id]
        return [Fail(entry.request_id, pending.fallback)]

    def _can_take(self, index: int, msg: Any) -> bool:
        link = self.links[index]
        return link.phase is LinkPhase.LIVE and (link.version >= 2 or not isinstance(msg, AdoptRequest))

    def _live_links(self) -> list[int]:
        """The live schedulers, starting one further along at each call."""
        start = self._next_link
        self._next_link = (start + 1) % len(self.links)
        order = list(range(start, len(self.links))) + list(range(start))
        return [index for index in order if self.links[index].phase is LinkPhase.LIVE]

    def _abort_everywhere(self, abort: AbortRequest) -> list[Action]:
        """Send abort to every live scheduler: the one holding the request stops it; given abort.worker_id, the
        others forward it to that worker (the scheduler that routed the request may be the one that died)."""
        self._aborted[abort.request_id] = None
        if len(self._aborted) > MAX_REMEMBERED_ABORTS:
            self._aborted.popitem(last=False)
        # NOTE: a silent one may still hold the request
        return [Send(index, abort) for index, link in enumerate(self.links) if link.phase is not LinkPhase.LOST]

    def check_invariants(self) -> None:
        for link in self.links:
            assert (link.phase is LinkPhase.SILENT) == (link.silent_since_s is not None), link
            assert link.epoch >= 0 and link.version >= 1, link
        for request_id, entry in self.requests.items():
            assert entry.request_id == request_id
            assert (entry.request is None) == (entry.phase in HAS_OUTPUT), entry
            assert (entry.worker_id == "") == (entry.phase is Phase.QUEUED), entry
            assert entry.phase is not Phase.QUEUED or entry.prefill_worker_id == "", entry
            assert entry.phase is not Phase.STREAMING or entry.prefill_worker_id == "", entry
            assert 0 <= entry.num_resends <= self.max_resends, entry
            if entry.link is not None:
                assert 0 <= entry.link < len(self.links), entry
                assert entry.link_epoch <= self.links[entry.link].epoch, entry
            assert entry.pending is None, entry  # every send is reported before the next event
