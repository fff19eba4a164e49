"""The MessagePack boundary under hostile input: every bound socket of every service gets N frames from a seeded
generator (random bytes, random MessagePack, mutated and field-fuzzed valid messages, wrong types, extra frames)
and one frame over MAX_FRAME_BYTES; afterwards every process is alive and the cluster still serves."""
from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import requests
import zmq

from shared import transport
from shared.messages import (AbortRequest, AdoptRequest, BlocksRemoved, BlocksStored, CacheSnapshot, ChatMessage,
                             GenerateError, GenerateRequest, KVEventBatch, RequestFinished, RequestRouted,
                             SamplingSpec, SnapshotRequest, StatusRequest, TokenBatch, TokenizedRequest,
                             TokenOutputs, WorkerGone, WorkerHeartbeat, WorkerLoad, encode)
from tests.reliability.cluster import MODEL, Cluster, completion, scheduler_status, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NUM_FRAMES = int(os.environ.get("RADIXSERVE_FUZZ_FRAMES", "2000"))  # per socket
SEED = int(os.environ.get("RADIXSERVE_FUZZ_SEED", "8"))
PAST = 1.0  # a deadline long gone: fuzzed requests that still decode are refused, not generated


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("zmqfuzz"))
    try:
        c.start_redis()
        c.start_observer()
        c.start_cache_index()
        c.start_scheduler()
        c.start_worker(0)
        c.start_tokenizer(0)
        c.start_gateway(1)
        c.wait_workers(1)
        c.wait_http(c.url)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def sink(cluster: Cluster) -> Iterator[str]:
    """A PULL that swallows whatever the services send to the reply addresses of fuzzed messages."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    addr = cluster.ipc("sink")
    sock.bind(addr)
    stopping = threading.Event()

    def drain() -> None:
        while not stopping.is_set():
            if sock.poll(50):
                sock.recv_multipart()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    yield addr
    stopping.set()
    thread.join(2)
    sock.close()


def corpus(sink: str) -> dict[str, list[msgspec.Struct]]:
    """Valid messages of each socket's accepted types, the seeds of the mutations."""
    spec = SamplingSpec(max_tokens=4, temperature=0.0, n=1)
    tokenized = TokenizedRequest("fz-t", [5, 6, 7, 8] * 5, [11, 12], spec, sink, PAST, deadline_s=PAST, model_id=MODEL)
    load = WorkerLoad(0, 0, 0, 10, 10)
    return {
        "tokenizer": [GenerateRequest("fz-g", spec, prompt_token_ids=[5, 6, 7], deadline_s=PAST),
                      GenerateRequest("fz-c", spec, messages=[ChatMessage("user", "hi")], stop=["x"], deadline_s=PAST),
                      AbortRequest("fz-g")],
        "tokenizer-stream": [TokenBatch("fz-w", [TokenOutputs("fz-g", 0, [1, 2], None, None, 3, 0),
                                                 TokenOutputs("fz-g", 0, [], None, "stop", 3, 0)]),
                             GenerateError("fz-g", 500, "server_error", "x", worker_lost=True),
                             RequestRouted("fz-g", "fz-w")],
        "scheduler": [tokenized, AbortRequest("fz-t"),
                      WorkerHeartbeat("fz-phantom", "i1", sink, MODEL, "mixed", 16, load),
                      RequestFinished("fz-t", "fz-phantom"), WorkerGone("fz-phantom"), StatusRequest(),
                      AdoptRequest("fz-a", "fz-phantom", sink), AbortRequest("fz-a", worker_id="fz-phantom")],
        "worker": [tokenized, AbortRequest("fz-t"), SnapshotRequest(sink)],
        "cache_index": [KVEventBatch("fz-phantom", sink, "i1", 0, [BlocksStored([1, 2], None, [0] * 32, 16),
                                                                  BlocksRemoved([1])]),
                        CacheSnapshot("fz-phantom", "i1", 3, [2, 3]), WorkerGone("fz-phantom")],
    }


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "bigint", "float", "str", "bytes", "none", "bool"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-2**16, 2**16)
    if kind == "bigint":
        return rng.choice([-2**63, 2**63 - 1, 2**64 - 1, 2**31, -1, 0])
    if kind == "float":
        return rng.choice([float("nan"), float("inf"), -0.0, 1e308, rng.random()])
    if kind == "str":
        return "".join(rng.choice("ab/:\x00é\U0001f600tcpip") for _ in range(rng.randint(0, 20)))
    if kind == "bytes":
        return rng.randbytes(rng.randint(0, 20))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {str(_random_value(rng, 3)): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _field_fuzz(rng: random.Random, msg: msgspec.Struct) -> bytes:
    """A valid message with one field (maybe the type tag, maybe one inside a nested struct such as
    `sampling`) replaced by a random value."""
    body = msgspec.to_builtins(msg)
    target = body
    nested = [v for v in body.values() if isinstance(v, dict)]
    if nested and rng.random() < 0.5:
        target = rng.choice(nested)
    target[rng.choice(list(target))] = _random_value(rng)
    return msgspec.msgpack.encode(body)


def _mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    buf = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and buf:
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif op == 2:
        del buf[rng.randrange(len(buf) + 1):]
    elif op == 3:
        at = rng.randrange(len(buf) + 1)
        buf[at:at] = rng.randbytes(rng.randint(1, 16))
    elif op == 4 and buf:
        at, size = rng.randrange(len(buf)), rng.randint(1, 32)
        buf[at:at] = buf[at:at + size] * rng.randint(1, 64)
    else:
        buf = buf[:rng.randrange(len(buf) + 1)] + other[rng.randrange(len(other) + 1):]
    return bytes(buf)


def fuzz_frames(rng: random.Random, seeds: list[msgspec.Struct], strangers: list[msgspec.Struct],
                num_frames: int) -> Iterator[list[bytes]]:
    """num_frames hostile messages (each a list of frames) built from seeds, strangers (other sockets' types)."""
    encoded = [encode(m) for m in seeds]
    makers: list[Callable[[], bytes]] = [
        lambda: rng.randbytes(rng.randint(0, 512)),
        lambda: msgspec.msgpack.encode(_random_value(rng)),
        lambda: _mutate(rng, rng.choice(encoded), rng.choice(encoded)),
        lambda: _mutate(rng, rng.choice(encoded), rng.choice(encoded)),
        lambda: _field_fuzz(rng, rng.choice(seeds)),
        lambda: _field_fuzz(rng, rng.choice(seeds)),
        lambda: encode(rng.choice(strangers)),
        lambda: b"\x91" * rng.randint(1, 100_000) + b"\xc0",  # deeply nested arrays
    ]
    for _ in range(num_frames):
        frames = [rng.choice(makers)()]
        if rng.random() < 0.05:
            frames = [rng.randbytes(rng.randint(0, 8))] + frames  # a stray extra frame in front
        yield frames


TARGETS = {  # socket name → (address in the cluster, the socket kind that talks to it)
    "tokenizer": ("tokenizer0", zmq.DEALER),
    "tokenizer-stream": ("tokenizer0-stream", zmq.PUSH),
    "scheduler": ("scheduler", zmq.DEALER),
    "worker": ("worker0", zmq.PUSH),
    "cache_index": ("cache_index", zmq.PUSH),
}


def test_every_socket_survives_hostile_frames_and_the_cluster_still_serves(cluster: Cluster, sink: str) -> None:
    rng = random.Random(SEED)
    seeds = corpus(sink)
    ctx = zmq.Context.instance()
    num_sent: dict[str, int] = {}
    for name, (addr_name, kind) in TARGETS.items():
        strangers = [m for other, msgs in seeds.items() if other != name for m in msgs]
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(cluster.ipc(addr_name))
        num_sent[name] = 0
        for frames in fuzz_frames(rng, seeds[name], strangers, NUM_FRAMES):
            sock.send_multipart(frames)
            num_sent[name] += 1
        sock.close()  # linger: the frames leave before the next socket's
        oversized = ctx.socket(kind)
        oversized.setsockopt(zmq.LINGER, 2000)
        oversized.connect(cluster.ipc(addr_name))
        oversized.send(b"\x00" * (transport.MAX_FRAME_BYTES + 1))  # ZeroMQ refuses it and drops the link
        oversized.close()
        assert cluster.dead_services() == [], f"fuzzing {name} killed a service"
    assert num_sent == {name: NUM_FRAMES for name in TARGETS}
    # Every process is alive and the cluster still answers: a phantom worker a fuzzed heartbeat registered
    # expires, the real worker drains what got through, and a real request is served end to end.
    time.sleep(1.5)
    wait_until(lambda: (load := cluster.observer.load("worker0")) and load.num_running == 0
               and load.num_waiting == 0, 30)
    wait_until(lambda: (s := scheduler_status(cluster.scheduler_addr)) and s.num_workers == 1, 10)
    for i in range(3):
        resp = requests.post(cluster.url + "/v1/completions", json=completion(MODEL, [5 + i, 6, 7, 8], 3),
                             timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
    assert cluster.dead_services() == []
    for name in ("tokenizer0", "scheduler", "worker0", "cache_index"):
        assert '"task died' not in cluster.services[name].log_text()
