"""Thin ZeroMQ wrappers: typed send/receive of MessagePack frames, size limits, and a pool of PUSH sockets."""
from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from shared.messages import decode, encode

log = structlog.get_logger(__name__)

MAX_FRAME_BYTES = 64 << 20  # a larger frame is refused by ZeroMQ before it is read
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
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(addr)
    return sock


def connect(kind: int, addr: str, identity: bytes | None = None) -> zmq.asyncio.Socket:
    sock = _socket(kind)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind in (zmq.PUSH, zmq.DEALER):
        sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(addr)
    return sock


def bound_addr(sock: zmq.asyncio.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def send(sock: zmq.asyncio.Socket, msg: msgspec.Struct, identity: bytes | None = None) -> None:
    """Send msg; with identity (a ROUTER), a peer that is not connected (any more) gets nothing, logged."""
    frames = [identity, encode(msg)] if identity is not None else [encode(msg)]
    try:
        await sock.send_multipart(frames)
    except zmq.ZMQError as exc:
        if identity is None or exc.errno != zmq.EHOSTUNREACH:
            raise
        log.warning("dropped message to a peer that is not connected", peer=identity[:64], message=type(msg).__name__)


Handler = Callable[[Any, bytes | None], Awaitable[None]]


async def receive_forever(sock: zmq.asyncio.Socket, accepts: Any, handle: Handler,
                          has_identity: bool = False) -> None:
    """Decode each frame as one of `accepts` and hand it to handle(msg, identity).

    A malformed, unknown or oversized frame is logged and dropped; a handler's exception is logged and
    the loop goes on, so one bad message never stops a service.
    """
    while True:
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
    """One PUSH socket per peer address, made on first use (a worker replying to many tokenizers)."""

    def __init__(self) -> None:
        self._sockets: dict[str, zmq.asyncio.Socket] = {}

    async def send(self, addr: str, msg: msgspec.Struct) -> None:
        """Send msg to addr; an address ZeroMQ refuses (a peer's garbage reply_addr) drops msg, logged."""
        sock = self._sockets.get(addr)
        if sock is None:
            sock = _socket(zmq.PUSH)
            try:
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.connect(addr)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                log.warning("dropped message to an invalid address", addr=addr[:200], error=str(exc)[:200],
                            message=type(msg).__name__)
                return
            self._sockets[addr] = sock
        await send(sock, msg)

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
