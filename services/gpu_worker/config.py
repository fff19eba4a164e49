"""The gpu_worker service's one frozen config (CLI flags / RADIXSERVE_* env), and the EngineConfig it implies.

NOTE: torch-free to import (torch loads only when a config is built), so that `radixserve serve` takes its
workers' flags, choices and help from this dataclass.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.gpu_worker.gemv_option import GEMV_MAX_TOKENS_LIMIT, parse_gemv_max_tokens
from shared.config import check_fields

if TYPE_CHECKING:
    from services.gpu_worker.engine_config import EngineConfig

ROLES = ("mixed", "prefill", "decode")
KV_TRANSFERS = ("auto", "shm", "cuda_ipc", "stream")


@dataclass(frozen=True)
class WorkerConfig:
    """gpu_worker: one model replica on one device, fed by schedulers, streaming tokens to tokenizers."""

    worker_id: str = field(default="", metadata={"help": "unique worker name (empty: hostname-pid)"})
    worker_addr: str = field(default="tcp://127.0.0.1:5570",
                             metadata={"help": "PULL address to bind for TokenizedRequest/AbortRequest"})
    scheduler_addrs: str = field(default="tcp://127.0.0.1:5560",
                                 metadata={"help": "comma-separated scheduler ROUTER addresses"})
    cache_index_addr: str = field(default="", metadata={"help": "cache_index PULL address (empty: no KV events)"})
    role: str = field(default="mixed", metadata={"help": "mixed, prefill or decode", "choices": ROLES})
    model: str = field(default="bundled", metadata={"help": "bundled, a Hugging Face directory, or random:<preset>"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:N"})
    dtype: str = field(default="auto", metadata={"help": "auto, float32, bfloat16, float16"})
    seed: int = field(default=0, metadata={"help": "weights seed of random:<preset> models"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page (and per hashed block)"})
    num_pages: int = field(default=0, metadata={"help": "KV pages (0: sized automatically)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto (the model's dtype) or fp8 (e4m3: half the bytes per cached token, not bit-exact)",
        "choices": ("auto", "fp8")})
    quantization: str = field(default="none", metadata={
        "help": "weights: none (the model's dtype), fp8 (W8A8: e4m3 weights with per-channel scales, activations "
                "per token; half the weight bytes) or awq / gptq (INT4 weight-only in groups of 128, quantized on "
                "load; a quarter of the weight bytes) or gguf (the bundled GGUF's own 4-bit blocks as INT4). A "
                "quantized checkpoint (AWQ, GPTQ, compressed-tensors FP8) loads as published without this flag. "
                "Costs in quality and speed: docs/PERFORMANCE.md",
        "choices": ("none", "fp8", "awq", "gptq", "gguf")})
    speculative_method: str = field(default="none", metadata={
        "help": "speculative decoding: none, ngram (prompt lookup: draft tokens copied from where the sequence's "
                "last tokens occurred before) or draft (greedy tokens of --speculative-draft-model); drafts are "
                "verified in one forward and greedy output is unchanged. A request's `speculative: false` turns it "
                "off for that request", "choices": ("none", "ngram", "draft")})
    speculative_draft_model: str = field(default="", metadata={
        "help": "speculative method draft: the draft model (bundled, a Hugging Face directory or random:<preset>) "
                "with the target's tokenizer; it runs on the same device with its own KV pool, k decode steps per "
                "verify step (empty: none)"})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "speculative decoding: most draft tokens a sequence proposes per step (fewer while they are "
                "rejected)"})
    gemv_max_tokens: str = field(default="auto", metadata={
        "help": f"CUDA: steps of at most this many tokens (0-{GEMV_MAX_TOKENS_LIMIT}) run their matmuls on the Triton "
                "GEMV instead of cuBLAS (0: never, all on cuBLAS; auto: 1 on a single-GPU worker, which speeds up "
                "batch-1 decode on the H200, else 0). Dense weights only: FP8-quantized layers read their e4m3 "
                "weights on the GEMV at one token whatever this says", "parse": parse_gemv_max_tokens})
    max_num_batched_tokens: int = field(default=0, metadata={
        "help": "token budget of one engine step (0: from the device: 512 on the CPU, 8192 on CUDA)"})
    max_num_seqs: int = field(default=0, metadata={
        "help": "most sequences running at once (0: from the device: 256 on the CPU; on CUDA as many as the KV "
                "pool holds at 2048 tokens each, 16-1024)"})
    max_model_len: int = field(default=0, metadata={"help": "context limit (0: the model's)"})
    enable_prefix_cache: bool = field(default=True, metadata={"help": "keep the radix prefix cache on"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "GPUs (or CPU processes) one model is split over; this process is rank 0, ranks 1..N-1 are "
                "spawned (mixed role only)"})
    heartbeat_interval_s: float = field(default=0.5, metadata={"help": "seconds between heartbeats"})
    transfer_addr: str = field(default="tcp://127.0.0.1:0",
                               metadata={"help": "prefill role: ROUTER address serving KV pages (stream backend)"})
    kv_transfer: str = field(default="auto", metadata={"help": "decode side: auto (by placement), shm, cuda_ipc "
                                                               "or stream; prefill side: stream disables shm",
                                                       "choices": KV_TRANSFERS})
    lease_ttl_s: float = field(default=30.0,
                               metadata={"help": "prefill role: seconds a decode worker has to pull a prompt's KV"})
    host_id: str = field(default="", metadata={"help": "placement identity for KV transfer (empty: hostname)"})
    num_pull_threads: int = field(default=2, metadata={"help": "decode side: concurrent KV pulls"})
    drain_timeout_s: float = field(default=0.0, metadata={
        "help": "on a stop signal, seconds the worker keeps serving what it has (its heartbeats say draining, so "
                "schedulers route it nothing new) before it fails what is left and stops (0, the default: no "
                "drain, as under `serve`, whose gateway drains first; Kubernetes sets it)"})
    health_file: str = field(default="", metadata={
        "help": "path rewritten at every heartbeat with 'serving' or 'draining' (its age tells a probe the event "
                "loop runs; empty: none)"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.scheduler_addr_list:
            raise ValueError("scheduler_addrs names no scheduler")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.lease_ttl_s <= 0 or self.num_pull_threads < 1:
            raise ValueError("lease_ttl_s must be > 0 and num_pull_threads >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and self.role != "mixed":
            raise ValueError(f"tensor parallelism runs the mixed role only, not {self.role!r} (no PD handoff yet)")
        self._check_engine_config()

    def _check_engine_config(self) -> None:
        """The engine's own checks of the fields it takes (here torch loads), and the FP8 cache's page rule."""
        from services.gpu_worker.engine_config import KV_CACHE_DTYPES
        from services.gpu_worker.kv_cache import check_page_size

        self.engine_config()
        if KV_CACHE_DTYPES[self.kv_cache_dtype] is not None:
            check_page_size(KV_CACHE_DTYPES[self.kv_cache_dtype], self.page_size)

    @property
    def scheduler_addr_list(self) -> list[str]:
        return [addr.strip() for addr in self.scheduler_addrs.split(",") if addr.strip()]

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def resolved_host_id(self) -> str:
        return self.host_id or socket.gethostname()

    def engine_config(self) -> EngineConfig:
        from services.gpu_worker.engine_config import EngineConfig

        return EngineConfig(model=self.model, device=self.device, dtype=self.dtype, page_size=self.page_size,
                            num_pages=self.num_pages or None, kv_cache_dtype=self.kv_cache_dtype,
                            gemv_max_tokens=parse_gemv_max_tokens(self.gemv_max_tokens),
                            max_num_batched_tokens=self.max_num_batched_tokens or None,
                            max_num_seqs=self.max_num_seqs or None, max_model_len=self.max_model_len or None,
                            enable_prefix_cache=self.enable_prefix_cache, seed=self.seed,
                            tensor_parallel_size=self.tensor_parallel_size,
                            quantization=None if self.quantization == "none" else self.quantization,
                            speculative_method=None if self.speculative_method == "none" else self.speculative_method,
                            num_speculative_tokens=self.num_speculative_tokens,
                            speculative_draft_model=self.speculative_draft_model or None)
