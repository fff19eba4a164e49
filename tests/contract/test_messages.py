"""Wire types: every Struct in shared/messages.py round-trips through the codec, and decodes from each socket
union that accepts it; stray and garbage messages fail at the boundary; engine metrics in heartbeats and the
MetricsRequest / MetricsReply pair (protocol 3); the tokenize and detokenize pairs (protocol 4)."""
from __future__ import annotations

import inspect
import types

import msgspec
import pytest

from shared import messages
from shared.messages import (PROTOCOL_VERSION, TokenizerPing, TokenizerPong, AbortRequest, AdoptRequest, AllBlocksCleared, BlocksRemoved,
                             BlocksStored, CacheSnapshot, ChatMessage, ChatToolCall, CudaIpcHandle, EngineMetrics, GatewayInbound,
                             GenerateChunk,
                             GenerateError, GenerateRequest, HandoffAccepted, HistogramCounts, KVEvent, KVEventBatch,
                             KVReady, KVSource, MetricsReply, MetricsRequest, PagesChunk, PagesRequest, PrefillRequest,
                             ReleaseLease, RequestFinished, RequestRouted, SchedulerInbound,
                             SchedulerReply, SnapshotRequest, StatusReply, StatusRequest, TokenBatch, TokenizedRequest,
                             DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest, TokenizerInbound,
                             TokenLogprobEntry, TokenOutputs, TokenPiece, ToolFunction, TransferStats, WorkerGone, WorkerHeartbeat,
                             WorkerLoad, decode, encode)
from shared.sampling import SamplingParams


def _engine_metrics() -> EngineMetrics:
    histogram = HistogramCounts([0.001, 0.5, 2.0], [4, 0, 1, 2], 9.25)
    return EngineMetrics(num_requests_running=3, num_requests_waiting=1, num_total_pages=511, num_request_pages=40,
                         num_cached_pages=100, num_preemptions=2, num_prefix_queries=2**40, num_prefix_hits=12,
                         num_prompt_tokens=2**40, num_generation_tokens=77, queue_time_s=histogram,
                         step_time_s=histogram, step_tokens=HistogramCounts([1.0, 8.0], [0, 5, 1], 41.0),
                         step_sequences=HistogramCounts([], [3], 3.0))


def _heartbeat(**fields: object) -> WorkerHeartbeat:
    return WorkerHeartbeat("w0", "inc", "ipc://w0", "m", "mixed", 16, WorkerLoad(1, 2, 3, 4, 5), **fields)


SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=2**63 - 1, stop_token_ids=(2, 3),
                        n=2, logprobs=3)
LOGPROB = TokenLogprobEntry(5, -0.25, [(5, -0.25), (9, -1.5)])
TOKENIZED = TokenizedRequest("r1", [1, 2, 3, 4, 5], [2**64 - 1], SAMPLING, "ipc://tok0", 1.7e9, deadline_s=1.7e9 + 30,
                             model_id="m", wants_routed=True)
IPC_HANDLE = CudaIpcHandle(0, b"\x00\xffhandle", 1 << 30, 4096, b"ref", 8, b"event", True)
KV_SOURCE = KVSource("host-a", "cuda", 30, 1024, 16, 3, 64, "bfloat16", stream_addr="tcp://10.0.0.1:7000",
                     shm_name="rs-kv", cuda_k=IPC_HANDLE, cuda_v=IPC_HANDLE)

# Every Struct in shared/messages.py, with examples that set its optional fields (and, where it matters, leave
# them at their defaults). test_every_message_type_has_examples fails for a new type missing here.
EXAMPLES: dict[type[msgspec.Struct], list[msgspec.Struct]] = {
    BlocksStored: [BlocksStored([2**64 - 1, 0, 12345], None, list(range(12)), 4),
                   BlocksStored([7], 2**63 + 5, [4294967295, 1, 2, 3], 4)],
    BlocksRemoved: [BlocksRemoved([1, 2**64 - 1]), BlocksRemoved([])],
    AllBlocksCleared: [AllBlocksCleared()],
    KVEventBatch: [KVEventBatch("w0", "ipc://w0-snap", "inc", 41,
                                [BlocksStored([1], None, [1, 2], 2), BlocksRemoved([1]), AllBlocksCleared()]),
                   KVEventBatch("w0", "ipc://w0-snap", "inc", 0, [])],
    SamplingParams: [SamplingParams(), SAMPLING],
    ChatMessage: [ChatMessage("user", "héllo 😀"),
                  ChatMessage("assistant", "", [ChatToolCall("call_1", "f", '{"a": 1}')]),
                  ChatMessage("tool", "21", tool_call_id="call_1")],
    ChatToolCall: [ChatToolCall("call_1", "get_weather", '{"city": "Paris"}')],
    ToolFunction: [ToolFunction("f"), ToolFunction("get_weather", "Weather", '{"type": "object"}')],
    GenerateRequest: [GenerateRequest("r1", SamplingParams(), prompt_text="hi", stop=["\n\n"], deadline_s=1.5e9),
                      GenerateRequest("r4", SAMPLING, messages=[ChatMessage("user", "u")],
                                      tools=[ToolFunction("f", "d", "{}")], is_tool_call_required=True),
                      GenerateRequest("r2", SAMPLING, prompt_token_ids=[1, 2], skip_special_tokens=False),
                      GenerateRequest("r3", SAMPLING, messages=[ChatMessage("system", "s"), ChatMessage("user", "u")])],
    AbortRequest: [AbortRequest("r1"), AbortRequest("r1", reason="client_gone", worker_id="w1")],
    TokenLogprobEntry: [LOGPROB, TokenLogprobEntry(1, 0.0)],
    TokenPiece: [TokenPiece(5, "Hello", b"Hello"), TokenPiece(218, "bytes:\\x80", b"\x80")],
    TokenizedRequest: [TOKENIZED, TokenizedRequest("r2", [1], [], SamplingParams(), "ipc://tok0", 0.0)],
    RequestRouted: [RequestRouted("r1", "w1"), RequestRouted("r1", "w-decode", prefill_worker_id="w-prefill")],
    AdoptRequest: [AdoptRequest("r1", "w1", "ipc://tok0", prefill_worker_id="w-prefill")],
    TokenOutputs: [TokenOutputs("r1", 1, [5, 6], [LOGPROB, LOGPROB], "stop", 5, 4),
                   TokenOutputs("r1", 0, [], None, None, 5, 0)],
    TokenBatch: [TokenBatch("w0", [TokenOutputs("r1", 0, [5], None, None, 5, 0),
                                   TokenOutputs("r2", 1, [6], [LOGPROB], "length", 3, 0)])],
    GenerateChunk: [GenerateChunk("r1", 0, "Hello", [19556]),
                    GenerateChunk("r1", 1, "", [], logprobs=[LOGPROB], token_texts=["\ufffd"], finish_reason="stop",
                                  num_prompt_tokens=7, num_cached_tokens=4),
                    GenerateChunk("r1", 0, "", [218], logprobs=[LOGPROB], token_texts=["bytes:\\x80"],
                                  token_pieces=[TokenPiece(218, "bytes:\\x80", b"\x80"),
                                                TokenPiece(9, "é", b"\xc3\xa9")])],
    GenerateError: [GenerateError("r1", 429, "rate_limit_error", "busy", retry_after_s=1.5),
                    GenerateError("r1", 503, "server_error", "worker lost", worker_lost=True),
                    GenerateError("r1", 400, "invalid_request_error", "too long",
                                  error_code="context_length_exceeded", param="messages")],
    TokenizeRequest: [TokenizeRequest("r1", prompt_text="hi", add_special_tokens=False),
                      TokenizeRequest("r2", messages=[ChatMessage("user", "u")])],
    TokenizeReply: [TokenizeReply("r1", [1, 2, 3], 8192), TokenizeReply("r2", [], 1)],
    DetokenizeRequest: [DetokenizeRequest("r1", [1, 2, 3]), DetokenizeRequest("r2", [])],
    DetokenizeReply: [DetokenizeReply("r1", "Hello"), DetokenizeReply("r2", "")],
    TokenizerPing: [TokenizerPing(1234.5)],
    TokenizerPong: [TokenizerPong("ipc:///tmp/tok0", "inc", 1234.5, ["cmpl-1", "cmpl-2-0"]),
                    TokenizerPong("tcp://10.0.0.3:5555", "inc2", 0.0, [])],
    WorkerLoad: [WorkerLoad(1, 2, 3, 4, 5), WorkerLoad(1, 2, 3, 4, 5, num_cached_pages=6, num_leased_pages=7,
                                                       max_num_seqs=256)],
    WorkerHeartbeat: [_heartbeat(), _heartbeat(transfer=TransferStats(num_handoffs=1, pull_seconds=0.5),
                                                metrics=_engine_metrics())],
    RequestFinished: [RequestFinished("r1", "w0"), RequestFinished("r1", "w-prefill", handed_off=True)],
    WorkerGone: [WorkerGone("w0")],
    SnapshotRequest: [SnapshotRequest("ipc://cache-index")],
    CacheSnapshot: [CacheSnapshot("w0", "inc", 42, [1, 2**64 - 1])],
    StatusRequest: [StatusRequest()],
    StatusReply: [StatusReply(["m"], 1, 0, 0, "inc"), StatusReply([], 0, 3, 2)],
    HistogramCounts: [HistogramCounts([0.5], [1, 2], 3.5)],
    EngineMetrics: [_engine_metrics()],
    MetricsRequest: [MetricsRequest("r1")],
    MetricsReply: [MetricsReply("r1", b"# TYPE x gauge\nx 1.0\n")],
    TransferStats: [TransferStats(), TransferStats(1, 2, 3, 4, 5, 6, 7, 2**40, 1.25)],
    CudaIpcHandle: [IPC_HANDLE],
    KVSource: [KV_SOURCE, KVSource("host-b", "cpu", 2, 8, 4, 1, 8, "float32")],
    PrefillRequest: [PrefillRequest(TOKENIZED, "w-decode", "ipc://w-decode")],
    KVReady: [KVReady(TOKENIZED, 42, LOGPROB, 4, [3, 4], KV_SOURCE, "w-prefill", "ipc://w-prefill", "lease-1",
                      1.7e9 + 5),
              KVReady(TOKENIZED, 42, None, 0, [], KV_SOURCE, "w-prefill", "ipc://w-prefill", "lease-2", 0.0)],
    HandoffAccepted: [HandoffAccepted("r1", "w-decode")],
    ReleaseLease: [ReleaseLease("lease-1", "r1"), ReleaseLease("lease-1", "r1", num_pages_pulled=3)],
    PagesRequest: [PagesRequest("lease-1", [3, 4]), PagesRequest("lease-1", [], max_chunk_bytes=1)],
    PagesChunk: [PagesChunk("lease-1", 0, 2, b"\x01" * 64, b"\x02" * 64, True),
                 PagesChunk("lease-1", 0, 0, b"", b"", True, error="lease expired")],
}
ALL_EXAMPLES = [msg for examples in EXAMPLES.values() for msg in examples]


def _module_structs() -> list[type[msgspec.Struct]]:
    """Every Struct class the module names: its own and those it imports for its fields (SamplingParams)."""
    classes = {cls for _, cls in inspect.getmembers(messages, inspect.isclass) if issubclass(cls, msgspec.Struct)}
    return sorted(classes, key=lambda cls: cls.__name__)


def _unions() -> dict[str, tuple[type, ...]]:
    """What each socket decodes into, by name: the module's unions (KVEvent, *Inbound, *Reply) and its aliases of
    a single tagged type (TransferInbound = PagesRequest)."""
    unions = {}
    for name, value in vars(messages).items():
        if isinstance(value, types.UnionType) and all(inspect.isclass(a) for a in value.__args__):
            unions[name] = value.__args__
        elif inspect.isclass(value) and issubclass(value, msgspec.Struct) and name != value.__name__ \
                and _is_tagged(value):
            unions[name] = (value,)
    return unions


def _is_tagged(cls: type[msgspec.Struct]) -> bool:
    return cls.__struct_config__.tag is not None


def _union_cases() -> list[tuple[msgspec.Struct, str]]:
    return [(msg, name) for name, members in _unions().items() for msg in ALL_EXAMPLES if type(msg) in members]


def test_every_message_type_has_examples() -> None:
    structs = _module_structs()
    assert [cls.__name__ for cls in structs if cls not in EXAMPLES] == []
    assert [cls.__name__ for cls in EXAMPLES if cls not in structs] == []
    assert all(type(msg) is cls for cls, examples in EXAMPLES.items() for msg in examples)


def test_every_tagged_message_is_accepted_by_some_socket() -> None:
    in_a_union = {cls for members in _unions().values() for cls in members}
    assert [cls.__name__ for cls in _module_structs() if _is_tagged(cls) and cls not in in_a_union] == []
    assert all(_is_tagged(cls) for cls in in_a_union)


@pytest.mark.parametrize("msg", ALL_EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_by_type(msg: msgspec.Struct) -> None:
    decoded = decode(encode(msg), type(msg))
    assert decoded == msg
    if _is_tagged(type(msg)):
        assert decoded.version == PROTOCOL_VERSION


@pytest.mark.parametrize("msg, union", _union_cases(), ids=lambda x: x if isinstance(x, str) else type(x).__name__)
def test_decodes_from_each_union_that_accepts_it(msg: msgspec.Struct, union: str) -> None:
    decoded = decode(encode(msg), getattr(messages, union))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("union", sorted(_unions()))
def test_a_stray_message_fails_at_the_boundary(union: str) -> None:
    members = _unions()[union]
    strays = [msg for msg in ALL_EXAMPLES if _is_tagged(type(msg)) and type(msg) not in members]
    assert strays
    for msg in strays:
        with pytest.raises(msgspec.ValidationError):
            decode(encode(msg), getattr(messages, union))


def test_structs_are_frozen() -> None:
    assert [cls.__name__ for cls in _module_structs() if not cls.__struct_config__.frozen] == []
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
    assert decoded.version == PROTOCOL_VERSION >= 3


@pytest.mark.parametrize("msg, union", [(TokenizeRequest("r1", prompt_text="a"), TokenizerInbound),
                                        (DetokenizeRequest("r1", [5]), TokenizerInbound),
                                        (TokenizeReply("r1", [5], 64), GatewayInbound),
                                        (DetokenizeReply("r1", "a"), GatewayInbound)],
                         ids=["tokenize", "detokenize", "tokenize-reply", "detokenize-reply"])
def test_tokenize_messages_round_trip(msg: msgspec.Struct, union: object) -> None:
    decoded = decode(encode(msg), union)
    assert decoded == msg
    assert decoded.version == PROTOCOL_VERSION >= 4


def test_chunk_of_an_older_tokenizer_decodes_without_token_pieces() -> None:
    old = {k: v for k, v in msgspec.to_builtins(EXAMPLES[GenerateChunk][2]).items() if k != "token_pieces"}
    decoded = decode(msgspec.msgpack.encode(old), GatewayInbound)
    assert isinstance(decoded, GenerateChunk)
    assert (decoded.token_pieces, decoded.token_texts) == (None, ["bytes:\\x80"])
