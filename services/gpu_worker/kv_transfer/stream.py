"""Byte-stream backend (workers on different hosts): the decode side asks the prefill side's transfer ROUTER
for leased pages; they come back as PagesChunk frames of raw K/V bytes, a few MiB each."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import msgspec
import structlog
import torch
import zmq
import zmq.asyncio

from services.gpu_worker.kv_cache import KVCache, raw
from services.gpu_worker.kv_transfer.base import DTYPES, TransferError, check_compatible, copy_into
from shared import transport
from shared.messages import KVSource, PagesChunk, PagesRequest, TransferInbound, TransferReply, decode, encode

log = structlog.get_logger(__name__)

PULL_TIMEOUT_S = 30.0  # longest wait for one chunk


def pages_per_chunk(bytes_per_page: int, max_chunk_bytes: int) -> int:
    """Pages in one chunk: as many as fit max_chunk_bytes (K and V together), at least one."""
    return max(1, max_chunk_bytes // max(1, bytes_per_page))


class PageServer:
    """Prefill side: serves PagesRequest for pages under a live lease (checked by is_leased)."""

    def __init__(self, addr: str, is_leased: Callable[[str, list[int]], bool],
                 read_pages: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._sock = transport.bind(zmq.ROUTER, addr)
        self.addr = transport.advertised(transport.bound_addr(self._sock))
        self._is_leased = is_leased
        self._read_pages = read_pages

    async def serve_forever(self) -> None:
        await transport.receive_forever(self._sock, TransferInbound, self._on_request, has_identity=True)

    async def _on_request(self, msg: PagesRequest, identity: bytes | None) -> None:
        if not self._is_leased(msg.lease_id, msg.page_ids):
            await self._send(PagesChunk(msg.lease_id, 0, 0, b"", b"", True, error="no such lease"), identity)
            return
        if not msg.page_ids:
            await self._send(PagesChunk(msg.lease_id, 0, 0, b"", b"", True), identity)
            return
        first_k, _ = await asyncio.to_thread(self._read_pages, msg.page_ids[:1])
        per_chunk = pages_per_chunk(2 * first_k.numel() * first_k.element_size(), msg.max_chunk_bytes)
        for first in range(0, len(msg.page_ids), per_chunk):
            ids = msg.page_ids[first:first + per_chunk]
            k, v = await asyncio.to_thread(self._read_pages, ids)  # [L, n, S, KVH, D] each
            chunk = PagesChunk(msg.lease_id, first, len(ids), _raw(k), _raw(v),
                               is_last=first + per_chunk >= len(msg.page_ids))
            await self._send(chunk, identity)

    async def _send(self, chunk: PagesChunk, identity: bytes | None) -> None:
        await transport.send(self._sock, chunk, identity or b"")

    def close(self) -> None:
        self._sock.close(linger=0)


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, C order (bfloat16 viewed as int16, FP8 as uint8: numpy has neither)."""
    t = raw(t.detach().contiguous().cpu())
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _from_raw(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


class StreamPuller:
    """Decode side: one DEALER per pull (ZeroMQ sockets stay in the thread that made them)."""

    def __init__(self, max_chunk_bytes: int = 8 << 20, timeout_s: float = PULL_TIMEOUT_S) -> None:
        self._context = zmq.Context.instance()
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s

    def pull(self, source: KVSource, lease_id: str, src_page_ids: list[int], dst_page_ids: list[int],
             kv: KVCache) -> int:
        check_compatible(source, kv)
        if not source.stream_addr:
            raise TransferError("the source has no stream address")
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
        sock.setsockopt(zmq.MAXMSGSIZE, transport.MAX_FRAME_BYTES)
        try:
            sock.connect(source.stream_addr)
            sock.send_multipart([b"", encode(PagesRequest(lease_id, src_page_ids, self.max_chunk_bytes))])
            return self._receive(sock, source, lease_id, dst_page_ids, kv)
        finally:
            sock.close(linger=0)

    def _receive(self, sock: zmq.Socket, source: KVSource, lease_id: str, dst_page_ids: list[int],
                 kv: KVCache) -> int:
        dtype = DTYPES[source.dtype]
        num_bytes, num_received = 0, 0
        while True:
            if not sock.poll(int(self.timeout_s * 1000)):
                raise TransferError(f"no pages from {source.stream_addr} within {self.timeout_s}s")
            try:
                chunk = decode(sock.recv_multipart()[-1], TransferReply)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise TransferError(f"malformed page chunk: {exc}") from exc
            if chunk.error or chunk.lease_id != lease_id:
                raise TransferError(chunk.error or "a chunk of another lease")
            if chunk.num_pages:
                shape = (source.num_layers, chunk.num_pages, source.page_size, source.num_kv_heads, source.head_dim)
                k = _from_raw(chunk.k, dtype if dtype != torch.bfloat16 else torch.int16, shape)
                v = _from_raw(chunk.v, dtype if dtype != torch.bfloat16 else torch.int16, shape)
                if dtype == torch.bfloat16:
                    k, v = k.view(torch.bfloat16), v.view(torch.bfloat16)
                copy_into(kv, dst_page_ids[chunk.first:chunk.first + chunk.num_pages], k, v)
                num_bytes += len(chunk.k) + len(chunk.v)
                num_received += chunk.num_pages
            if chunk.is_last:
                if num_received != len(dst_page_ids):
                    raise TransferError(f"got {num_received} of {len(dst_page_ids)} pages")
                return num_bytes
