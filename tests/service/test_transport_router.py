"""shared.transport's ROUTER over ipc://: nothing sent to a slow peer is dropped, and a gone peer raises nothing."""
from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import zmq
import zmq.asyncio

from shared import transport
from shared.messages import GenerateChunk, GatewayInbound, decode

NUM_MESSAGES = 5000  # past ZeroMQ's default queue to one peer (1,000 send + 1,000 receive)


def _chunk(i: int) -> GenerateChunk:
    return GenerateChunk(request_id=f"r{i}", index=0, text="", token_ids=[i], logprobs=None, token_texts=None,
                         finish_reason=None, num_prompt_tokens=1, num_cached_tokens=0)


async def _router_and_peer(addr: str) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, bytes]:
    router = transport.bind(zmq.ROUTER, addr)
    peer = transport.connect(zmq.DEALER, addr, identity=b"gateway-1")
    await peer.send_multipart([b"hello"])
    identity = (await router.recv_multipart())[0]
    return router, peer, identity


def test_router_waits_for_a_slow_peer_instead_of_dropping() -> None:
    async def run() -> list[int]:
        with tempfile.TemporaryDirectory(prefix="rst") as tmp:
            router, peer, identity = await _router_and_peer(f"ipc://{Path(tmp) / 'r'}")
            sender = asyncio.ensure_future(_send_all(router, identity))
            await asyncio.sleep(0.5)  # the peer reads nothing meanwhile
            received = []
            while len(received) < NUM_MESSAGES and await peer.poll(2000):
                received.append(decode((await peer.recv_multipart())[-1], GatewayInbound).token_ids[0])
            await asyncio.wait_for(sender, 10)
            router.close(linger=0)
            peer.close(linger=0)
            return received

    assert asyncio.run(run()) == list(range(NUM_MESSAGES))


async def _send_all(router: zmq.asyncio.Socket, identity: bytes) -> None:
    for i in range(NUM_MESSAGES):
        await transport.send(router, _chunk(i), identity)


def test_send_to_a_peer_that_is_gone_is_dropped_without_raising() -> None:
    async def run() -> int:
        with tempfile.TemporaryDirectory(prefix="rst") as tmp:
            router, peer, identity = await _router_and_peer(f"ipc://{Path(tmp) / 'r'}")
            await transport.send(router, _chunk(0), b"no-such-peer")
            await transport.send(router, _chunk(1), identity)
            token_id = decode((await peer.recv_multipart())[-1], GatewayInbound).token_ids[0]
            router.close(linger=0)
            peer.close(linger=0)
            return token_id

    assert asyncio.run(run()) == 1
