"""Wire types: KV event round-trips, union decoding by tag, garbage rejected; engine metrics in heartbeats and the
MetricsRequest / MetricsReply pair (protocol 3)."""
from __future__ import annotations

import msgspec
import pytest

from shared.messages import (PROTOCOL_VERSION, AllBlocksCleared, BlocksRemoved, BlocksStored, EngineMetrics,
                             HistogramCounts, KVEvent, MetricsReply, MetricsRequest, SchedulerInbound, SchedulerReply,
                             StatusReply, WorkerHeartbeat, WorkerLoad, decode, encode)

EXAMPLES = [
    BlocksStored([2**64 - 1, 0, 12345], None, list(range(12)), 4),
    BlocksStored([7], 2**63 + 5, [4294967295, 1, 2, 3], 4),
    BlocksRemoved([1, 2**64 - 1]),
    BlocksRemoved([]),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_by_type(msg: msgspec.Struct) -> None:
    assert decode(encode(msg), type(msg)) == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_decodes_from_union(msg: msgspec.Struct) -> None:
    decoded = decode(encode(msg), KVEvent)
    assert type(decoded) is type(msg)
    assert decoded == msg
    assert decoded.version == PROTOCOL_VERSION


def test_structs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        BlocksRemoved([1]).block_hashes = [2]  # type: ignore[misc]


@pytest.mark.parametrize("data", [b"", b"\xff\x00garbage", b"\xc1", encode({"type": "Nope"}),
                                  encode({"block_hashes": [1]}), encode([1, 2, 3])])
def test_garbage_raises_decode_error(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode(data, KVEvent)


def test_wrong_field_type_raises_decode_error() -> None:
    data = encode({"type": "BlocksRemoved", "block_hashes": ["x"]})
    with pytest.raises(msgspec.DecodeError):
        decode(data, KVEvent)


# --- engine metrics in heartbeats; MetricsRequest / MetricsReply (protocol 3) ---------------------------------

def _engine_metrics() -> EngineMetrics:
    histogram = HistogramCounts([0.001, 0.5, 2.0], [4, 0, 1, 2], 9.25)
    return EngineMetrics(num_requests_running=3, num_requests_waiting=1, num_total_pages=511, num_request_pages=40,
                         num_cached_pages=100, num_preemptions=2, num_prefix_queries=2**40, num_prefix_hits=12,
                         num_prompt_tokens=2**40, num_generation_tokens=77, queue_time_s=histogram,
                         step_time_s=histogram, step_tokens=HistogramCounts([1.0, 8.0], [0, 5, 1], 41.0),
                         step_sequences=HistogramCounts([], [3], 3.0))


def _heartbeat(**fields: object) -> WorkerHeartbeat:
    return WorkerHeartbeat("w0", "inc", "ipc://w0", "m", "mixed", 16, WorkerLoad(1, 2, 3, 4, 5), **fields)


def test_heartbeat_with_engine_metrics_round_trips() -> None:
    hb = _heartbeat(metrics=_engine_metrics())
    decoded = decode(encode(hb), SchedulerInbound)
    assert decoded == hb
    assert decoded.metrics.step_tokens.counts == [0, 5, 1]


def test_heartbeat_of_an_older_worker_decodes_without_metrics() -> None:
    old = {k: v for k, v in msgspec.to_builtins(_heartbeat()).items() if k != "metrics"}
    old["version"] = 2
    decoded = decode(msgspec.msgpack.encode(old), SchedulerInbound)
    assert isinstance(decoded, WorkerHeartbeat)
    assert decoded.metrics is None


@pytest.mark.parametrize("msg, union", [(MetricsRequest("r1"), SchedulerInbound),
                                        (MetricsReply("r1", b"# TYPE x gauge\nx 1.0\n"), SchedulerReply),
                                        (StatusReply(["m"], 1, 0, 0, "inc"), SchedulerReply)],
                         ids=["request", "reply", "status"])
def test_metrics_messages_round_trip(msg: msgspec.Struct, union: object) -> None:
    decoded = decode(encode(msg), union)
    assert type(decoded) is type(msg)
    assert decoded == msg
    assert decoded.version == PROTOCOL_VERSION == 3
