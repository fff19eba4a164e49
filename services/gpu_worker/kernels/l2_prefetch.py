"""Weights into the L2 cache while the step's small kernels run: an attempt to use the memory bus's idle time at
small batches. Measured on the H200, it makes every step slower, so the engine leaves it off (EngineConfig.l2_prefetch).

A batch-1 decode step reads ~15 GB of weights through its GEMMs at near copy speed, and between them runs small
kernels (RMSNorm, the decode attention and its reduce, SiLU·mul) that are bound by latency: for ~0.4 ms of a
4.4 ms step the HBM carries almost nothing. An `L2Prefetcher` tries to fill that time. Before each run of small
kernels it launches, on a side stream, a kernel that asks the L2 to fetch the leading bytes of the next GEMM's
weight: `cp.async.bulk.prefetch.L2`, one instruction per chunk ("bulk"; "bulk_last" with an evict-last policy), or
`prefetch.global.L2::evict_last` per 128-byte line ("lines"). The GEMM then finds those bytes there. Nothing waits
for the prefetch kernel until the end of the forward (`join`). Results are unchanged bit for bit: a prefetch moves
no data a kernel can see.

Why it loses (bench/h200_probe.py --phases l2pf, docs/PERFORMANCE.md): the GEMMs do get faster (3,870 → 3,847 µs
a step), but the prefetch traffic raises the memory latency that the small kernels wait on (RMSNorm 171 → 203 µs,
decode attention 161 → 191 µs), and their windows (2-8 µs) are too short for a side-stream kernel to fill.

Which bytes are "leading" depends on the order the GEMM reads its weight [N, K] (K contiguous): "cols" takes the
first bytes of K in every row, split into `segments` equal parts of K (a split-K GEMM reads its S slices of K side
by side, so the first bytes of each slice come first); "rows" takes the matrix's first bytes (whole leading rows).

The CPU tests run Triton's interpreter, which has no PTX: there the prefetcher is never on (`supported`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import hopper

LAYOUTS = ("cols", "rows")
GEMMS = ("qkv", "o", "gate_up", "down", "lm_head")
MODES = ("bulk", "bulk_last", "lines")
LINE = 128  # bytes of one L2 line; the "lines" mode prefetches one per instruction
# $3: whether this lane has a chunk (a masked lane issues nothing)
_BULK_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                         "mov.u32 $0, 0; }")
_BULK_LAST_PTX = tl.constexpr("{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
                              "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                              "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")
_LINE_PTX = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
                         "mov.u32 $0, 0; }")


@triton.jit
def _prefetch_kernel(base_ptr, sink_ptr, num_chunks, row_bytes, seg_stride, sink_guard,
                     CHUNKS_PER_SEG: tl.constexpr, NUM_SEGS: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr, BULK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Chunk i of the region: row i // (NUM_SEGS · CHUNKS_PER_SEG), then segment, then chunk within it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    per_row: tl.constexpr = NUM_SEGS * CHUNKS_PER_SEG
    row = offs // per_row
    seg = (offs % per_row) // CHUNKS_PER_SEG
    piece = offs % CHUNKS_PER_SEG
    byte = row.to(tl.int64) * row_bytes + seg * seg_stride + piece.to(tl.int64) * CHUNK
    valid = (offs < num_chunks).to(tl.int32)
    addr = base_ptr + byte * valid
    if BULK:
        size = tl.full([BLOCK], CHUNK, tl.int32)
        done = tl.inline_asm_elementwise(_BULK_LAST_PTX if EVICT_LAST else _BULK_PTX, "=r,l,r,r", [addr, size, valid],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        done = tl.inline_asm_elementwise(_LINE_PTX, "=r,l,r", [addr, valid], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + offs, done, mask=offs < sink_guard)  # the guard is 0: keeps the results live, stores none


@dataclass(frozen=True)
class Region:
    """rows × segments × chunks_per_seg chunks of `chunk` bytes: row r's segment s starts at byte
    r · row_bytes + s · seg_stride of the weight."""
    rows: int
    segments: int
    chunks_per_seg: int
    chunk: int
    row_bytes: int
    seg_stride: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.segments * self.chunks_per_seg * self.chunk


def plan(shape: tuple[int, int], element_size: int, nbytes: int, layout: str, segments: int = 1,
         chunk: int = 256) -> Region | None:
    """The leading `nbytes` (at most; whole chunks) of a contiguous weight [N, K] in the GEMM's read order; None
    when that is not one chunk. cols: the first bytes of each of `segments` equal slices of every row; rows: the
    matrix's first bytes, whole rows and on (`segments` ignored)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if chunk < 16 or chunk % 16:
        raise ValueError(f"a prefetch chunk must be a positive multiple of 16 bytes, not {chunk}")
    n, k = shape
    row_bytes = k * element_size
    if layout == "rows":  # one contiguous run: a single "row" of the whole matrix
        count = min(n * row_bytes, nbytes) // chunk
        return Region(1, 1, count, chunk, 0, 0) if count else None
    if segments < 1 or row_bytes % segments:
        segments = 1
    seg_bytes = row_bytes // segments
    per_seg = min(seg_bytes // chunk, nbytes // (n * segments * chunk))
    return Region(n, segments, per_seg, chunk, row_bytes, seg_bytes) if per_seg else None


def supported(device: torch.device | str) -> bool:
    """The prefetch kernel can run here: a CUDA device of compute capability >= 9.0 (the bulk prefetch is Hopper's),
    compiled kernels (the interpreter has no PTX)."""
    return hopper.is_hopper(device)


def resolve(mode: str, device: torch.device | str) -> bool:
    """EngineConfig.l2_prefetch → on/off: "auto" is on where supported; "on" where unsupported is an error."""
    return hopper.resolve(mode, "l2_prefetch", "the L2 prefetch", mode != "off" and supported(device), device)


def prefetch(weight: torch.Tensor, region: Region, mode: str = "bulk", block: int = 128) -> None:
    """Launch the prefetch of `region` of `weight` on the current stream (CUDA only): one chunk per thread."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if not weight.is_contiguous():
        raise ValueError("the prefetch plans over a contiguous weight")
    chunk, per_seg = region.chunk, region.chunks_per_seg
    if mode == "lines":  # one instruction per line: the same bytes as LINE-sized chunks
        if chunk % LINE:
            raise ValueError(f"the lines mode needs chunks of a multiple of {LINE} bytes, not {chunk}")
        per_seg, chunk = per_seg * (chunk // LINE), LINE
    num_chunks = region.rows * region.segments * per_seg
    base = weight.view(-1).view(torch.uint8)
    grid = (triton.cdiv(num_chunks, block),)
    _prefetch_kernel[grid](base, _sink(weight.device, block), num_chunks, region.row_bytes, region.seg_stride, 0,
                           CHUNKS_PER_SEG=per_seg, NUM_SEGS=region.segments, CHUNK=chunk, BLOCK=block,
                           BULK=mode != "lines", EVICT_LAST=mode == "bulk_last", num_warps=4)


_SINKS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _sink(device: torch.device, block: int) -> torch.Tensor:
    key = (device, block)
    if key not in _SINKS:
        _SINKS[key] = torch.empty(block, dtype=torch.int32, device=device)
    return _SINKS[key]


@dataclass(frozen=True)
class PrefetchConfig:
    """What the forward prefetches: up to `mib` MiB of each GEMM's weight, in `layout` order and `chunk`-byte
    requests, while the kernels before that GEMM run; at steps of at most `max_tokens` tokens (above that the GEMMs
    are no longer bound by their weights' reads). `gemms`: which of GEMMS. The defaults are the least slow of the
    H200 sweep (docs/PERFORMANCE.md): no setting there made a step faster."""
    mib: float = 4.0
    layout: str = "rows"
    mode: str = "bulk"
    max_tokens: int = 8
    gemms: tuple[str, ...] = GEMMS
    chunk: int = 65536

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS or self.mode not in MODES:
            raise ValueError(f"layout must be one of {LAYOUTS} and mode one of {MODES}")
        unknown = set(self.gemms) - set(GEMMS)
        if unknown or self.mib < 0 or self.max_tokens < 0:
            raise ValueError(f"bad prefetch config: gemms {sorted(unknown)}, mib {self.mib}, "
                             f"max_tokens {self.max_tokens}")


class L2Prefetcher:
    """Issues a forward's prefetches on one side stream; `join` makes the current stream wait for them (a CUDA
    graph's capture must end with every forked stream joined)."""

    def __init__(self, config: PrefetchConfig, device: torch.device | str) -> None:
        self.config = config
        self.stream = torch.cuda.Stream(device=device)
        self._plans: dict[tuple, Region | None] = {}
        self._forked = False

    def active(self, num_tokens: int) -> bool:
        return self.config.mib > 0 and num_tokens <= self.config.max_tokens

    def issue(self, gemm: str, weight: torch.Tensor, segments: int = 1) -> None:
        """Prefetch the leading bytes of `weight` for the GEMM named `gemm`, after the work queued so far."""
        if gemm not in self.config.gemms:
            return
        key = (tuple(weight.shape), weight.element_size(), segments)
        if key not in self._plans:
            cfg = self.config
            self._plans[key] = plan(key[0], key[1], int(cfg.mib * 2**20), cfg.layout, segments, cfg.chunk)
        region = self._plans[key]
        if region is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            prefetch(weight, region, self.config.mode)
        self._forked = True

    def join(self) -> None:
        if self._forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._forked = False


class NoPrefetch:
    """The forward's prefetcher when there is none, or its step has too many tokens: asks for nothing."""

    def issue(self, gemm: str, weight: torch.Tensor, segments: int = 1) -> None:
        pass

    def join(self) -> None:
        pass


NO_PREFETCH = NoPrefetch()
DEFAULT_CONFIG = PrefetchConfig()  # the engine's (EngineConfig.l2_prefetch)
