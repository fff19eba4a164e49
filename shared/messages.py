"""Wire types exchanged between services, as tagged msgspec Structs, and their msgpack codec."""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from shared.sampling import SamplingParams

# Every message carries its sender's PROTOCOL_VERSION. Changes are additive: new fields have defaults (an older
# receiver ignores them) and a new message type goes only to a peer that asked for it or said it knows it.
# 1: the first protocol.
# 2: tokenizer ↔ scheduler failover: TokenizedRequest.wants_routed → RequestRouted; AdoptRequest (sent only to a
#    scheduler whose StatusReply says version >= 2); AbortRequest.worker_id; GenerateError.worker_lost;
#    StatusReply.incarnation.
# 3: MetricsRequest → MetricsReply (gateway ↔ scheduler; sent only to a scheduler whose StatusReply says
#    version >= 3); WorkerHeartbeat.metrics.
# 4: TokenizeRequest → TokenizeReply and DetokenizeRequest → DetokenizeReply (gateway ↔ tokenizer; an older
#    tokenizer drops them, and the gateway answers 503 when no reply comes in time).
# 5: TokenizerPing → TokenizerPong (gateway ↔ tokenizer; an older tokenizer drops the ping, and a gateway that hears
#    no pong declares no request lost).
# 6: tool calling (gateway → tokenizer): GenerateRequest.tools and .is_tool_call_required; ChatMessage.tool_calls
#    and .tool_call_id (an older tokenizer ignores them: it renders the messages' contents and no tools).
# 7: structured output: SamplingParams.output_constraint (shared/output_constraint.py), set by the gateway from
#    response_format, guided_* and tool_choice required/named; an older worker ignores it (the output is free).
# 8: prompt logprobs: SamplingParams.prompt_logprobs and max_tokens 0; TokenOutputs.prompt_logprobs (worker →
#    tokenizer), GenerateChunk.prompt_logprobs and .prompt_token_ids (tokenizer → gateway); TokenLogprobEntry.rank.
#    An older worker refuses max_tokens 0 (400) and ignores prompt_logprobs; the gateway then gets none.
PROTOCOL_VERSION = 8

T = TypeVar("T")


class BlocksStored(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: these consecutive full pages, chained after parent_hash, entered its radix cache.

    block_hashes[i] covers token_ids[i * page_size:(i + 1) * page_size]; parent_hash is None at the root.
    """

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    page_size: int
    version: int = PROTOCOL_VERSION


class BlocksRemoved(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: these pages left the worker's radix cache (evicted)."""

    block_hashes: list[int]
    version: int = PROTOCOL_VERSION


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: the worker's radix cache was emptied; forget everything it held."""

    version: int = PROTOCOL_VERSION


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: events numbered first_seq, first_seq+1, ... in this worker's order.

    A gap in the numbers (or a new `incarnation` after a worker restart) means events were lost:
    cache_index then asks for a snapshot.
    """

    worker_id: str
    worker_addr: str  # where cache_index sends a SnapshotRequest
    incarnation: str
    first_seq: int
    events: list[KVEvent]
    version: int = PROTOCOL_VERSION


# The former wire name of SamplingParams (shared/sampling.py), the one Struct that gateway, wire and engine share.
SamplingSpec = SamplingParams


class ChatToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant message of the history made: its id, the function's name and its arguments
    as the JSON text of an object (as OpenAI sends them)."""

    id: str
    name: str
    arguments: str


class ToolFunction(msgspec.Struct, frozen=True):
    """A function tool a chat request offers the model; parameters is the JSON text of its JSON schema ("": none)."""

    name: str
    description: str = ""
    parameters: str = ""


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat message; an assistant's may carry tool_calls (protocol 6), a `tool` message answers the call
    tool_call_id."""

    role: str
    content: str
    tool_calls: list[ChatToolCall] = []
    tool_call_id: str = ""


class GenerateRequest(msgspec.Struct, frozen=True, tag=True):
    """gateway → tokenizer: one completion or chat request, already validated.

    Exactly one of prompt_text, prompt_token_ids, messages is set. Results stream back to the
    gateway identity that sent this, as GenerateChunk / GenerateError.
    """

    request_id: str
    sampling: SamplingParams
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    stop: list[str] = []
    skip_special_tokens: bool = True
    deadline_s: float | None = None  # unix time after which the request is dropped
    tools: list[ToolFunction] = []  # protocol 6: rendered into a chat prompt (its template's way, or a system prompt)
    is_tool_call_required: bool = False  # protocol 6: the prompt asks for a call (tool_choice required or named)
    version: int = PROTOCOL_VERSION


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    """gateway → tokenizer → scheduler → worker: stop this request now and free its pages.

    worker_id (protocol 2) names the worker the sender knows the request runs on: the abort then concerns that
    run only. A scheduler that routed the request there stops it as usual; one that did not (it never saw the
    request, or routed it elsewhere) forwards the abort to that worker, so an abort still arrives after the
    scheduler that routed the request died.
    """

    request_id: str
    reason: str = "abort"
    worker_id: str = ""
    version: int = PROTOCOL_VERSION


class TokenLogprobEntry(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int | None = None  # protocol 8: 1 + the tokens more likely than token_id (prompt logprobs carry it)


class TokenPiece(msgspec.Struct, frozen=True):
    """One vocabulary token as logprobs show it: raw is its own bytes (maybe part of a UTF-8 character); text is
    raw as UTF-8, or "bytes:" and raw with each invalid byte written \\xNN (as OpenAI shows such tokens)."""

    token_id: int
    text: str
    raw: bytes


class TokenizedRequest(msgspec.Struct, frozen=True, tag=True):
    """tokenizer → scheduler → worker: the prompt as token ids, its block hashes, and where to stream tokens."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[int]
    sampling: SamplingParams
    reply_addr: str  # the tokenizer's PULL address for TokenBatch
    arrival_s: float
    deadline_s: float | None = None
    model_id: str = ""  # "" = any worker's model
    wants_routed: bool = False  # protocol 2: the scheduler sends RequestRouted to reply_addr once it is routed
    version: int = PROTOCOL_VERSION


class RequestRouted(msgspec.Struct, frozen=True, tag=True):
    """scheduler → tokenizer (reply_addr), protocol 2, when TokenizedRequest.wants_routed: the request went to
    worker_id (PD: its prefill leg to prefill_worker_id). If that scheduler dies, the tokenizer knows the request
    is on a worker (it hands it to another scheduler with AdoptRequest) rather than lost (it re-sends it)."""

    request_id: str
    worker_id: str
    prefill_worker_id: str = ""
    version: int = PROTOCOL_VERSION


class AdoptRequest(msgspec.Struct, frozen=True, tag=True):
    """tokenizer → scheduler, protocol 2: the scheduler that routed this request is gone and the request runs on
    worker_id (PD: its prefill leg, not yet handed off, on prefill_worker_id); take over its in-flight entry, so
    its abort is forwarded, its worker's death fails it and its seat is counted."""

    request_id: str
    worker_id: str
    reply_addr: str
    prefill_worker_id: str = ""
    version: int = PROTOCOL_VERSION


class TokenOutputs(msgspec.Struct, frozen=True):
    """The tokens one sample of one request produced in one engine step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobEntry] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    # protocol 8, sampling.prompt_logprobs: one per prompt token (None first), on the first output of each sample
    prompt_logprobs: list[TokenLogprobEntry | None] | None = None


class TokenBatch(msgspec.Struct, frozen=True, tag=True):
    """worker → tokenizer: every output one engine step made for requests this tokenizer sent."""

    worker_id: str
    outputs: list[TokenOutputs]
    version: int = PROTOCOL_VERSION


class GenerateChunk(msgspec.Struct, frozen=True, tag=True):
    """tokenizer → gateway: new text of one sample; the last chunk of a sample has finish_reason set."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobEntry] | None = None
    token_texts: list[str] | None = None  # decoded text of each token in token_ids (for logprobs)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    token_pieces: list[TokenPiece] | None = None  # each id of token_ids and of logprobs' top, once (for logprobs)
    # protocol 8: the prompt's logprobs (None first) and its ids, on a sample's first chunk; their ids and tops are
    # in token_pieces
    prompt_logprobs: list[TokenLogprobEntry | None] | None = None
    prompt_token_ids: list[int] | None = None
    version: int = PROTOCOL_VERSION


class GenerateError(msgspec.Struct, frozen=True, tag=True):
    """any service → gateway (via the tokenizer): the request failed; status is the HTTP status to return."""

    request_id: str
    status: int
    code: str  # OpenAI error type, e.g. "invalid_request_error", "server_error", "rate_limit_error"
    message: str
    retry_after_s: float | None = None
    worker_lost: bool = False  # protocol 2: its worker died or left; a tokenizer may re-send it if nothing streamed
    error_code: str | None = None  # OpenAI error code, e.g. "context_length_exceeded" (an older sender: none)
    param: str | None = None  # the request parameter at fault, as OpenAI names it
    version: int = PROTOCOL_VERSION


class TokenizeRequest(msgspec.Struct, frozen=True, tag=True):
    """gateway → tokenizer, protocol 4: the token ids of a prompt (exactly one of prompt_text, messages), as a
    generation would send them; answered with TokenizeReply, or GenerateError for a prompt it cannot tokenize.

    add_special_tokens concerns prompt_text (the tokenizer's own, e.g. BOS); messages get their chat template's."""

    request_id: str
    prompt_text: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    version: int = PROTOCOL_VERSION


class TokenizeReply(msgspec.Struct, frozen=True, tag=True):
    """tokenizer → gateway: the ids TokenizeRequest request_id asked for, and the context length in tokens that the
    tokenizer checks prompts against (0: not known there)."""

    request_id: str
    token_ids: list[int]
    max_model_len: int
    version: int = PROTOCOL_VERSION


class DetokenizeRequest(msgspec.Struct, frozen=True, tag=True):
    """gateway → tokenizer, protocol 4: the text of these token ids, special tokens included; answered with
    DetokenizeReply, or GenerateError for an id outside the vocabulary."""

    request_id: str
    token_ids: list[int]
    version: int = PROTOCOL_VERSION


class DetokenizeReply(msgspec.Struct, frozen=True, tag=True):
    """tokenizer → gateway: the text DetokenizeRequest request_id asked for."""

    request_id: str
    text: str
    version: int = PROTOCOL_VERSION


class TokenizerPing(msgspec.Struct, frozen=True, tag=True):
    """gateway → tokenizer, protocol 5: which of this gateway's requests do you hold? (the gateway's DEALER sends it
    to each tokenizer in turn; services/gateway/tokenizer_watch.py)"""

    sent_at: float  # the gateway's clock, echoed back
    version: int = PROTOCOL_VERSION


class TokenizerPong(msgspec.Struct, frozen=True, tag=True):
    """tokenizer → gateway: its name (the address it binds for gateways), its incarnation (new at every start) and the
    ids of the asking gateway's requests it holds, in answer to the TokenizerPing sent at sent_at."""

    name: str
    incarnation: str
    sent_at: float
    request_ids: list[str]
    version: int = PROTOCOL_VERSION


class WorkerLoad(msgspec.Struct, frozen=True):
    num_running: int
    num_waiting: int
    num_queued_tokens: int  # prompt tokens admitted but not yet prefilled
    num_free_pages: int
    num_total_pages: int
    num_cached_pages: int = 0  # pages the radix cache holds (idle worker: used pages == cached pages)
    num_leased_pages: int = 0  # prefill role: prompt pages held for decode workers to pull
    max_num_seqs: int = 0  # most sequences the worker runs at once (0: not reported, an older worker)


class WorkerHeartbeat(msgspec.Struct, frozen=True, tag=True):
    """worker → scheduler: I am alive at addr, serving model_id, with this load (every heartbeat interval)."""

    worker_id: str
    incarnation: str
    addr: str  # the worker's PULL address for TokenizedRequest / AbortRequest
    model_id: str
    role: str  # "mixed" | "prefill" | "decode"
    page_size: int
    load: WorkerLoad
    transfer: TransferStats | None = None  # PD counters since start (None from workers before PD)
    metrics: EngineMetrics | None = None  # protocol 3: the engine's counters and gauges (None from older workers)
    is_draining: bool = False  # stopping (SIGTERM): route it nothing new; it finishes what it has
    version: int = PROTOCOL_VERSION


class RequestFinished(msgspec.Struct, frozen=True, tag=True):
    """worker → scheduler: every sample of this request has ended (its in-flight entry can go)."""

    request_id: str
    worker_id: str
    handed_off: bool = False  # prefill worker: the request continues on its decode worker (KVReady sent)
    version: int = PROTOCOL_VERSION


class WorkerGone(msgspec.Struct, frozen=True, tag=True):
    """worker → scheduler (or scheduler → cache_index on a missed heartbeat): forget this worker."""

    worker_id: str
    version: int = PROTOCOL_VERSION


class SnapshotRequest(msgspec.Struct, frozen=True, tag=True):
    """cache_index → worker: send every block hash you hold (after a sequence gap or a restart)."""

    reply_addr: str
    version: int = PROTOCOL_VERSION


class CacheSnapshot(msgspec.Struct, frozen=True, tag=True):
    """worker → cache_index: the full set of block hashes in the worker's radix cache as of next_seq."""

    worker_id: str
    incarnation: str
    next_seq: int  # the seq number of the next KV event this worker will send
    block_hashes: list[int]
    version: int = PROTOCOL_VERSION


class StatusRequest(msgspec.Struct, frozen=True, tag=True):
    """gateway → scheduler: which models are served and is any worker up (for /health and /v1/models)."""

    version: int = PROTOCOL_VERSION


class StatusReply(msgspec.Struct, frozen=True, tag=True):
    """scheduler → gateway or tokenizer: live workers and their models; num_queued requests in the scheduler.

    Tokenizers send StatusRequest as a liveness ping; a new incarnation (protocol 2) means the scheduler restarted
    and forgot what it had routed.
    """

    model_ids: list[str]
    num_workers: int
    num_queued: int
    num_in_flight: int
    incarnation: str = ""
    version: int = PROTOCOL_VERSION


# --- metrics: engine counters in heartbeats, Prometheus text for the gateway's /metrics ---------------------

class HistogramCounts(msgspec.Struct, frozen=True):
    """A fixed-bucket histogram: counts[i] values in (bounds[i-1], bounds[i]], counts[-1] values above bounds[-1]
    (per bucket, not cumulative: len(counts) == len(bounds) + 1); sum of every value observed."""

    bounds: list[float]
    counts: list[int]
    sum: float


class EngineMetrics(msgspec.Struct, frozen=True):
    """A worker engine's gauges now and its counters since it started (vLLM's engine metrics; see README, Metrics).

    Prompt tokens, prefix-cache queries and hits and queue time count each sequence once, at its first admission.
    """

    num_requests_running: int  # sequences in the engine's running batch
    num_requests_waiting: int  # sequences in the engine's own waiting queue
    num_total_pages: int  # KV pool pages (page 0, reserved, excluded)
    num_request_pages: int  # pages held by requests (cached pages nobody holds, evictable, count as free)
    num_cached_pages: int  # pages the radix prefix cache holds
    num_preemptions: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache at first admission
    num_prefix_hits: int  # of those, tokens the cache served
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time_s: HistogramCounts  # request arrival (tokenizer) to the first engine step that schedules it
    step_time_s: HistogramCounts  # wall time of one engine step
    step_tokens: HistogramCounts  # tokens per engine step
    step_sequences: HistogramCounts  # sequences per engine step
    # speculative decoding (vLLM's spec_decode_*): sequence-steps that verified drafts, their drafts, those accepted
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


class MetricsRequest(msgspec.Struct, frozen=True, tag=True):
    """gateway → scheduler, protocol 3: your Prometheus text (own series and the engine series of live workers)."""

    request_id: str
    version: int = PROTOCOL_VERSION


class MetricsReply(msgspec.Struct, frozen=True, tag=True):
    """scheduler → gateway: the Prometheus text exposition (format 0.0.4) answering MetricsRequest request_id."""

    request_id: str
    text: bytes
    version: int = PROTOCOL_VERSION


# --- prefill/decode disaggregation: KV handed off by reference (see docs/ARCHITECTURE.md, "PD") ---------

class TransferStats(msgspec.Struct, frozen=True):
    """A worker's PD counters since it started (heartbeats carry them; tests and /metrics read them)."""

    num_handoffs: int = 0  # prefill: KVReady sent
    num_leases: int = 0  # prefill: leases held now
    num_leases_expired: int = 0  # prefill: leases ended by expiry (the decode side never released them)
    num_imports: int = 0  # decode: KVReady received and joined the batch
    num_import_fallbacks: int = 0  # decode: pull failed or lease ran out; the prompt was recomputed locally
    num_pages_pulled: int = 0  # decode: pages copied from prefill workers
    num_pages_reused: int = 0  # decode: prompt pages its own radix cache already held (not pulled)
    num_bytes_pulled: int = 0
    pull_seconds: float = 0.0  # decode: wall time spent in pulls (in transfer threads)


class CudaIpcHandle(msgspec.Struct, frozen=True):
    """torch's CUDA IPC handle of one storage (`UntypedStorage._share_cuda_()`), field for field."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class KVSource(msgspec.Struct, frozen=True):
    """Where a prefill worker's KV pool can be read, and its layout.

    The pool is `k` then `v`, each [num_layers, num_pages, page_size, num_kv_heads, head_dim] of dtype.
    A decode worker picks a backend by placement: shm (same host_id, cpu), cuda_ipc (same host_id, cuda),
    else stream (pages chunked over ZeroMQ from stream_addr).
    """

    host_id: str
    device_type: str  # "cpu" | "cuda"
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    stream_addr: str = ""  # ROUTER serving PagesRequest ("" = none)
    shm_name: str = ""  # POSIX shared-memory segment holding k then v ("" = none)
    cuda_k: CudaIpcHandle | None = None
    cuda_v: CudaIpcHandle | None = None


class PrefillRequest(msgspec.Struct, frozen=True, tag=True):
    """scheduler → prefill worker: compute the prompt, stream the first token, then hand the KV to decode_addr."""

    request: TokenizedRequest
    decode_worker_id: str
    decode_addr: str  # the decode worker's PULL address (for KVReady)
    version: int = PROTOCOL_VERSION


class KVReady(msgspec.Struct, frozen=True, tag=True):
    """prefill worker → decode worker: the prompt's KV sits in page_ids under a lease; pull what you lack.

    page_ids[i] holds prompt tokens [i * page_size, (i + 1) * page_size) (the last page may be partial).
    first_token was sampled from the prompt and already streamed to request.reply_addr; its KV is not
    computed (the decode worker feeds it next). Release the lease with ReleaseLease to prefill_addr.
    """

    request: TokenizedRequest
    first_token: int
    first_logprob: TokenLogprobEntry | None
    num_cached_tokens: int  # prompt tokens the prefill worker's cache served
    page_ids: list[int]
    source: KVSource
    prefill_worker_id: str
    prefill_addr: str  # the prefill worker's PULL address (for ReleaseLease)
    lease_id: str
    lease_expires_s: float  # unix time after which the pages may be reused
    version: int = PROTOCOL_VERSION


class HandoffAccepted(msgspec.Struct, frozen=True, tag=True):
    """decode worker → schedulers: KVReady arrived; the request no longer depends on its prefill worker.

    Until then the scheduler keeps the prefill leg open, so a prefill worker that dies before its KVReady
    reached the decode worker fails the request cleanly instead of leaving it hanging.
    """

    request_id: str
    worker_id: str
    version: int = PROTOCOL_VERSION


class ReleaseLease(msgspec.Struct, frozen=True, tag=True):
    """decode worker → prefill worker: done with this lease (pulled, aborted or failed); free its pages."""

    lease_id: str
    request_id: str
    num_pages_pulled: int = 0
    version: int = PROTOCOL_VERSION


class PagesRequest(msgspec.Struct, frozen=True, tag=True):
    """decode worker → prefill worker's transfer ROUTER (stream backend): send these leased pages."""

    lease_id: str
    page_ids: list[int]
    max_chunk_bytes: int = 8 << 20
    version: int = PROTOCOL_VERSION


class PagesChunk(msgspec.Struct, frozen=True, tag=True):
    """prefill worker → decode worker (stream backend): pages page_ids[first:first + num_pages] as raw bytes.

    k and v are each [num_layers, num_pages, page_size, num_kv_heads, head_dim] in the source dtype,
    C-contiguous. error is set (and the data empty) when the lease is unknown or expired.
    """

    lease_id: str
    first: int
    num_pages: int
    k: bytes
    v: bytes
    is_last: bool
    error: str = ""
    version: int = PROTOCOL_VERSION


GatewayInbound = GenerateChunk | GenerateError | TokenizeReply | DetokenizeReply | TokenizerPong
TokenizerInbound = GenerateRequest | AbortRequest | TokenizeRequest | DetokenizeRequest | TokenizerPing
TokenizerStreamInbound = TokenBatch | GenerateError | RequestRouted
SchedulerInbound = (TokenizedRequest | AbortRequest | WorkerHeartbeat | RequestFinished | WorkerGone
                    | StatusRequest | HandoffAccepted | AdoptRequest | MetricsRequest)
SchedulerReply = StatusReply | MetricsReply  # what a gateway receives from schedulers
WorkerInbound = TokenizedRequest | AbortRequest | SnapshotRequest | PrefillRequest | KVReady | ReleaseLease
TransferInbound = PagesRequest
TransferReply = PagesChunk
CacheIndexInbound = KVEventBatch | CacheSnapshot | WorkerGone

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    """Serialize one wire message to msgpack bytes."""
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T] | Any) -> T:
    """Deserialize msgpack bytes as type_ (a Struct or a union); bad input raises msgspec.DecodeError."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders.setdefault(type_, msgspec.msgpack.Decoder(type_))
    return decoder.decode(data)
