"""Thin ZeroMQ wrappers: typed send/receive of MessagePack frames, size limits, sends that wait a bounded time,
and a bounded pool of PUSH sockets."""
from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from shared.messages import decode, encode

log = structlog.get_logger(__name__)

MAX_FRAME_BYTES = 64 << 20  # a larger frame is refused by ZeroMQ before it is read
MAX_QUEUED_MESSAGES = 100_000  # SNDHWM of PUSH, DEALER and ROUTER sockets: messages queued for one peer
MAX_PEERS = 256  # PUSH sockets a PushPool keeps open (libzmq refuses a context's 1,024th socket)
MAX_HOLD_S = 0.02  # a receive loop with a backlog hands the event loop over after handling messages this long
MAX_SEND_WAIT_S = 1.0  # how long a PushPool send waits for room in a full peer's queue
_RETRY_FIRST_S, _RETRY_MAX_S = 0.001, 0.05  # pauses between the tries of a bounded send
_context: zmq.asyncio.Context | None = None


def context() -> zmq.asyncio.Context:
    global _context
    if _context is None or _context.closed:
        _context = zmq.asyncio.Context()
    return _context


def _socket(kind: int) -> zmq.asyncio.Socket:
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return sock


def bind(kind: int, addr: str) -> zmq.asyncio.Socket:
    """A socket bound at addr (ipc://path or tcp://host:port; tcp://127.0.0.1:0 picks a free port).

    NOTE: a ROUTER is made mandatory: by default ZeroMQ silently drops what a ROUTER sends to a peer whose queue
    is full (SNDHWM here plus the peer's RCVHWM, 1,000 + 1,000 messages by default). A tokenizer streaming 512
    requests' chunks to a gateway that lags lost whole chunks that way, so usage counts came out short with no
    error (issue 24). Mandatory, a send to a full peer waits instead, and one to a peer that is gone raises
    EHOSTUNREACH (send() drops that message, logged).
    """
    sock = _socket(kind)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.SNDHWM, MAX_QUEUED_MESSAGES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(addr)
    return sock


def connect(kind: int, addr: str, identity: bytes | None = None) -> zmq.asyncio.Socket:
    sock = _socket(kind)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind in (zmq.PUSH, zmq.DEALER):
        sock.setsockopt(zmq.SNDHWM, MAX_QUEUED_MESSAGES)
    sock.connect(addr)
    return sock


def bound_addr(sock: zmq.asyncio.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class DropReason(str, Enum):
    """Why a send gave a message up."""

    INVALID_ADDRESS = "invalid_address"  # ZeroMQ refused to connect to it (a peer's garbage reply_addr)
    NO_SOCKET = "no_socket"  # no socket could be made (libzmq's socket cap, or the process's file limit)
    PEER_FULL = "peer_full"  # the peer's queue stayed full for the whole wait: it does not read
    UNREACHABLE = "unreachable"  # ROUTER: the peer is not connected (any more)


async def send(sock: zmq.asyncio.Socket, msg: msgspec.Struct, identity: bytes | None = None,
               max_wait_s: float | None = None) -> DropReason | None:
    """Send msg; None once ZeroMQ queued it, else why it was dropped.

    max_wait_s=None waits for room in the peer's queue as long as it takes (for a caller that bounds the wait
    itself); a number gives up after that long, so a peer that never reads cannot hold the caller (0: never wait):
    PEER_FULL, for the caller to count and log (once per peer, not once per message).
    With identity (a ROUTER), a peer that is not connected (any more) gets nothing: UNREACHABLE, logged.
    """
    frames = [identity, encode(msg)] if identity is not None else [encode(msg)]
    try:
        if max_wait_s is None:
            await sock.send_multipart(frames)
        elif not await _send_bounded(sock, frames, max_wait_s):
            return DropReason.PEER_FULL
    except zmq.ZMQError as exc:
        if identity is None or exc.errno != zmq.EHOSTUNREACH:
            raise
        log.warning("dropped message to a peer that is not connected", peer=identity[:64], message=type(msg).__name__)
        return DropReason.UNREACHABLE
    return None


async def _send_bounded(sock: zmq.asyncio.Socket, frames: list[bytes], max_wait_s: float) -> bool:
    """Send frames without blocking; while the peer's queue is full, try again after growing pauses until
    max_wait_s has passed (False) or the socket was closed meanwhile (False).

    NOTE: only non-blocking tries, never a pending send future: such a future would wait past max_wait_s, and
    closing the socket under it would cancel its caller.
    """
    deadline_s = time.monotonic() + max_wait_s
    pause_s = _RETRY_FIRST_S
    while not sock.closed:
        try:
            await sock.send_multipart(frames, flags=zmq.DONTWAIT)
            return True
        except zmq.Again:
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            await asyncio.sleep(min(pause_s, remaining_s))
            pause_s = min(pause_s * 2, _RETRY_MAX_S)
    return False


Handler = Callable[[Any, bytes | None], Awaitable[None]]


async def receive_forever(sock: zmq.asyncio.Socket, accepts: Any, handle: Handler,
                          has_identity: bool = False) -> None:
    """Decode each frame as one of `accepts` and hand it to handle(msg, identity).

    A malformed, unknown or oversized frame is logged and dropped; a handler's exception is logged and
    the loop goes on, so one bad message never stops a service. NOTE: a receive of a frame already queued does not
    suspend, so a backlog (a burst of 1,000 requests) would hold the event loop until it is read, pings and timers
    waiting meanwhile: every MAX_HOLD_S the loop is yielded to the other tasks.
    """
    loop = asyncio.get_running_loop()
    held_since_s = loop.time()
    while True:
        if loop.time() - held_since_s >= MAX_HOLD_S:
            await asyncio.sleep(0)
            held_since_s = loop.time()
        frames = await sock.recv_multipart(copy=True)
        identity = frames[0] if has_identity and len(frames) > 1 else None
        try:
            msg = decode(frames[-1], accepts)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropped malformed frame", error=str(exc)[:200], size=len(frames[-1]))
            continue
        try:
            await handle(msg, identity)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the receive loop
            log.exception("handler failed", message=type(msg).__name__)


class PushPool:
    """PUSH sockets to peer addresses (a worker replying to many tokenizers), made on first use, at most
    max_peers of them: the least recently used is closed past that.

    A send never blocks its caller for long: when a peer's queue is full (MAX_QUEUED_MESSAGES unread), it waits at
    most max_wait_s for room, then drops the message and forgets the peer (its socket closed, its queue discarded).
    An address forgotten so is remembered: once its new queue fills up too, the send drops at once, without waiting.
    num_dropped counts the messages given up, by DropReason; num_forgotten the peers forgotten for not reading.

    NOTE: a socket closed (evicted or forgotten) discards what it still held: linger 0, so that closed sockets
    never pile up towards libzmq's cap.
    """

    def __init__(self, max_peers: int = MAX_PEERS, max_wait_s: float = MAX_SEND_WAIT_S) -> None:
        self.max_peers, self.max_wait_s = max_peers, max_wait_s
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()  # least recently used first
        self._undrained: OrderedDict[str, None] = OrderedDict()  # addresses forgotten for not reading
        self.num_dropped: Counter[DropReason] = Counter()
        self.num_forgotten = 0

    def __len__(self) -> int:
        return len(self._sockets)

    async def send(self, addr: str, msg: msgspec.Struct) -> DropReason | None:
        """Send msg to addr; None once queued, else why it was dropped (logged)."""
        sock = self._sockets.get(addr)
        if sock is None:
            sock = self._open(addr, msg)
            if isinstance(sock, DropReason):
                return self._dropped(sock)
        self._sockets.move_to_end(addr)
        max_wait_s = 0.0 if addr in self._undrained else self.max_wait_s
        if await _send_bounded(sock, [encode(msg)], max_wait_s):
            return None
        if self._sockets.get(addr) is sock:  # NOTE: not already forgotten by a concurrent send
            self.drop(addr)
            self.num_forgotten += 1
            self._undrained[addr] = None
            self._undrained.move_to_end(addr)
            if len(self._undrained) > self.max_peers:
                self._undrained.popitem(last=False)
            log.warning("dropped message to a peer that does not read; forgot it", addr=addr[:200],
                        message=type(msg).__name__, wait_s=max_wait_s, num_forgotten=self.num_forgotten,
                        num_dropped=sum(self.num_dropped.values()) + 1)
        return self._dropped(DropReason.PEER_FULL)

    def _open(self, addr: str, msg: msgspec.Struct) -> zmq.asyncio.Socket | DropReason:
        """A PUSH connected to addr, the least recently used socket closed if the pool is full; or why none."""
        while len(self._sockets) >= self.max_peers:
            self.drop(next(iter(self._sockets)))
        sock = None
        try:
            sock = _socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, MAX_QUEUED_MESSAGES)
            sock.connect(addr)
        except zmq.ZMQError as exc:
            if sock is not None:
                sock.close(linger=0)
            reason = DropReason.NO_SOCKET if sock is None else DropReason.INVALID_ADDRESS
            log.warning("dropped message: no socket to its address", reason=reason.value, addr=addr[:200],
                        error=str(exc)[:200], message=type(msg).__name__, num_sockets=len(self._sockets))
            return reason
        self._sockets[addr] = sock
        return sock

    def _dropped(self, reason: DropReason) -> DropReason:
        self.num_dropped[reason] += 1
        return reason

    def drop(self, addr: str) -> None:
        sock = self._sockets.pop(addr, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for addr in list(self._sockets):
            self.drop(addr)


def advertised(addr: str) -> str:
    """The address peers should connect to: a wildcard bind host becomes this machine's hostname
    (a container's name on the compose network)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if addr.startswith(wildcard):
            return f"tcp://{socket.gethostname()}:{addr[len(wildcard):]}"
    return addr
