"""The engine's one frozen config: model, device, KV pool size and batching limits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.gpu_worker.gemv_option import check_gemv_max_tokens
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.quant.apply import METHODS as QUANTIZATION_METHODS

SPECULATIVE_METHODS = ("ngram", "draft")  # the proposers spec/engine_step.make_proposer builds

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}

# Batching limits when the config leaves them to the device (None). A CPU steps slowly: small steps keep its
# tokens flowing. A GPU's step costs about the same from 1 to thousands of prefill tokens (the weights are read
# once either way), so it takes big chunks, and as many sequences as its KV pool holds at full length.
CPU_MAX_NUM_BATCHED_TOKENS = 512
CPU_MAX_NUM_SEQS = 256
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
AUTO_TOKENS_PER_SEQ = 2048  # CUDA: room for this many tokens per running sequence before any is preempted
AUTO_NUM_SEQS_MULTIPLE = 16
MIN_AUTO_NUM_SEQS, MAX_AUTO_NUM_SEQS = 16, 1024
CUDA_GRAPH_MIN_ADMIT_BATCH = 16


@dataclass(frozen=True)
class BatchingLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    reason: str  # how they were chosen, for the start-up log


@dataclass(frozen=True)
class EngineConfig:
    model: str = "bundled"  # "bundled", a Hugging Face directory, or "random:<preset>"
    device: str = "auto"  # "auto" → cuda when available, else cpu
    dtype: str = "auto"  # "auto" → bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_cache_bytes (cpu) or free memory (cuda)
    kv_cache_bytes: int = 2 << 30  # cpu KV budget when num_pages is None
    gpu_memory_utilization: float = 0.90
    # Token budget of one step (the chunked-prefill size) and most sequences running at once. None: chosen from
    # the device (resolved_batching): 512 and 256 on the CPU; on CUDA 8192, and the sequences that fit in the KV
    # pool at AUTO_TOKENS_PER_SEQ tokens each (16 to 1024).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    # Admission in batches (BatchPolicy._defers_admission): a step of decodes alone admits waiting sequences once this
    # many can start together (at most one per 16 running), or after max_admit_delay_steps steps. None: 16 where decode
    # steps replay CUDA graphs (an eager step costs the host ~36 ms on the H200, a replay ~3 ms), else 1 (off).
    min_admit_batch: int | None = None
    max_admit_delay_steps: int = 8
    enable_prefix_cache: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"  # "auto": triton on cuda, torch elsewhere
    enable_cuda_graphs: bool = True  # cuda + triton: replay captured decode steps (cuda_graphs.py)
    # Steps of at most this many tokens (0..16) run their projections and LM head on the Triton GEMV
    # (kernels/gemv.py) instead of cuBLAS; Triton backend only; 0: every matmul on cuBLAS. None, the default: 1 for
    # a single-rank Triton engine on CUDA, else 0. On the H200, 1 makes the batch-1 step 7 % faster; at 8 tokens the
    # GEMV is slower than cuBLAS (docs/PERFORMANCE.md).
    gemv_max_tokens: int | None = None
    seed: int = 0  # random weights' seed for random:<preset> models
    # The KV cache's dtype: "auto" (the model's dtype) or "fp8" (float8 e4m3, no scale: half the bytes per
    # token, so twice the tokens in the pool and half the KV reads of decode attention; not bit-exact to the
    # model dtype's cache: each cached K/V element keeps 3 mantissa bits)
    kv_cache_dtype: str = "auto"
    # Queue step N+1 before reading step N's tokens (engine.step). None: on for CUDA, where the host's work
    # then hides behind the GPU's; off on the CPU, where it would only delay each token by one step.
    enable_overlap: bool | None = None
    # Engine.warm_up at construction: made-up requests that make Triton compile the eager path's kernels before the
    # first real one. None: on for the Triton backend on CUDA in a single-rank engine, where kernels compile; off
    # elsewhere (the CPU interpreter compiles nothing, and tensor-parallel ranks step in lockstep from rank 0).
    warmup: bool | None = None
    # Ranks of one engine (parallel/): each holds 1/tp of the heads and MLP and of the KV cache. 1: no
    # torch.distributed at all; > 1: the Engine must be built inside a rank (parallel.start_engine / launch).
    tensor_parallel_size: int = 1
    # None: the weights in the model's dtype; else one of quant/apply.py's METHODS (fp8: W8A8; awq, gptq: INT4
    # W4A16 quantized on load), applied to every linear layer but the LM head and a MoE router
    quantization: str | None = None
    # Speculative decoding (spec/): None, "ngram" (prompt lookup: drafts copied from the sequence's own earlier
    # tokens) or "draft" (greedy drafts of speculative_draft_model, a small model with the target's tokenizer, on
    # its own engine and KV pool: spec/draft.py). Each decoding sequence proposes up to num_speculative_tokens drafts
    # a step (as many as its acceptance pays for, none in a step whose gains do not cover its cost: spec/adaptive.py),
    # verified in one forward; none while more than speculative_max_batch_size sequences decode at once. Steps with
    # drafts are not overlapped; a decode-only one replays a verify CUDA graph (cuda_graphs.VerifyGraphs, buckets up
    # to this size), a mixed one runs eager.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch_size: int = 32
    speculative_draft_model: str | None = None  # "draft" only: "bundled", a Hugging Face directory or random:<preset>

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, not {self.tensor_parallel_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), "
                             f"not {self.quantization!r}")
        if self.speculative_method is not None:
            self._check_speculative()
        if self.speculative_draft_model is not None and self.speculative_method != "draft":
            raise ValueError(f"a speculative draft model is used by speculative_method 'draft' only, not "
                             f"{self.speculative_method!r}")
        if self.warmup and self.tensor_parallel_size > 1:
            raise ValueError("warmup runs on a single-rank engine only (tensor-parallel ranks step in lockstep)")
        if self.gemv_max_tokens is not None:
            check_gemv_max_tokens(self.gemv_max_tokens)
        if (self.min_admit_batch is not None and self.min_admit_batch < 1) or self.max_admit_delay_steps < 0:
            raise ValueError("min_admit_batch must be >= 1 and max_admit_delay_steps >= 0")
        if any(v is not None and v < 1 for v in (self.max_num_batched_tokens, self.max_num_seqs)):
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1 (or None: from the device)")

    def _check_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} (or None), "
                             f"not {self.speculative_method!r}")
        if self.num_speculative_tokens < 1 or self.speculative_max_batch_size < 1:
            raise ValueError("num_speculative_tokens and speculative_max_batch_size must be >= 1")
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding runs on a single-rank engine only")
        if self.speculative_method == "draft" and not self.speculative_draft_model:
            raise ValueError("speculative_method 'draft' needs a draft model (speculative_draft_model)")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_overlap(self) -> bool:
        if self.enable_overlap is None:
            return self.resolved_device().startswith("cuda")
        return self.enable_overlap

    def resolved_warmup(self, backend: str) -> bool:
        if self.warmup is None:
            return backend == "triton" and self.resolved_device().startswith("cuda") and self.tensor_parallel_size == 1
        return self.warmup

    def resolved_gemv_max_tokens(self, backend: str) -> int:
        if self.gemv_max_tokens is None:
            on = backend == "triton" and self.resolved_device().startswith("cuda") and self.tensor_parallel_size == 1
            return 1 if on else 0
        return self.gemv_max_tokens

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().startswith("cuda") else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (choices: {', '.join(_DTYPES)})")
        return _DTYPES[self.dtype]

    def resolved_kv_dtype(self) -> torch.dtype:
        return self.resolved_dtype() if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]

    def resolved_min_admit_batch(self, has_cuda_graphs: bool) -> int:
        if self.min_admit_batch is None:
            return CUDA_GRAPH_MIN_ADMIT_BATCH if has_cuda_graphs else 1
        return self.min_admit_batch

    def resolved_batching(self, num_pages: int) -> BatchingLimits:
        """max_num_batched_tokens and max_num_seqs: as set, or chosen for the device and a pool of num_pages."""
        is_cuda = self.resolved_device().startswith("cuda")
        reasons = []
        num_tokens = self.max_num_batched_tokens
        if num_tokens is None:
            num_tokens = CUDA_MAX_NUM_BATCHED_TOKENS if is_cuda else CPU_MAX_NUM_BATCHED_TOKENS
            reasons.append(f"max_num_batched_tokens {num_tokens}: the {'CUDA' if is_cuda else 'CPU'} default")
        num_seqs = self.max_num_seqs
        if num_seqs is None and not is_cuda:
            num_seqs = CPU_MAX_NUM_SEQS
            reasons.append(f"max_num_seqs {num_seqs}: the CPU default")
        elif num_seqs is None:
            pool_tokens = (num_pages - 1) * self.page_size
            fit = pool_tokens // AUTO_TOKENS_PER_SEQ // AUTO_NUM_SEQS_MULTIPLE * AUTO_NUM_SEQS_MULTIPLE
            num_seqs = min(max(fit, MIN_AUTO_NUM_SEQS), MAX_AUTO_NUM_SEQS)
            reasons.append(f"max_num_seqs {num_seqs}: a KV pool of {pool_tokens} tokens holds {fit} sequences of "
                           f"{AUTO_TOKENS_PER_SEQ} tokens (kept within {MIN_AUTO_NUM_SEQS}-{MAX_AUTO_NUM_SEQS})")
        return BatchingLimits(num_tokens, num_seqs, "; ".join(reasons) or "both set by the config")

    def resolved_num_pages(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
        """Pages in the pool (page 0 included), at least enough for one full-length sequence on cpu.

        Under tensor parallelism this is one rank's pool: its pages hold num_kv_heads / tp heads, and
        kv_cache_bytes and the free-memory budget are per rank.
        """
        if self.num_pages is not None:
            if self.num_pages < 2:
                raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
            return self.num_pages
        num_kv_heads = cfg.num_kv_heads // self.tensor_parallel_size
        per_page = KVCache.bytes_per_page(cfg.num_layers, self.page_size, num_kv_heads, cfg.head_dim, dtype)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1 - self.gpu_memory_utilization) * total
        else:
            budget = self.kv_cache_bytes
        num_pages = int(budget // per_page)
        if num_pages < 2:
            raise ValueError(f"not enough memory for a KV cache ({budget / 2**20:.0f} MiB left)")
        return num_pages
