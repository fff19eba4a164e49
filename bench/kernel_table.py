"""Each Triton kernel the engine runs, checked against its torch reference and timed as GPU work inside a CUDA graph.

A row gives the kernel's µs per call; the bytes a call must move (each tensor it reads or writes, once); those bytes
over the time as TB/s and as a fraction of the copy bandwidth measured in the same run; and the call's error against
the kernel's reference on the same inputs (‖out − ref‖ / ‖ref‖; for argmax, the fraction of rows that differ).

Why graphs: `triton.testing.do_bench` around one eager launch also times the host's launch, 15–40 µs, for kernels
the GPU runs in 2–5 µs (docs/PERFORMANCE.md's first kernel table). Here a row's graph holds `calls` launches, each
over inputs of its own, and one replay (do_bench flushes L2 before it) is divided by `calls`. So each input comes
from DRAM, and a row is what the kernel costs as a node of the engine's graphs: its GPU time plus the gap to the
next node. The row `empty`, a kernel of one program that does nothing, is that floor.

    python -m bench.kernel_table --out $OUT [--tile-sweep] [--split-sweep] [--gemv-sweep] [--w4a16-sweep
        [--w4a16-tokens 8,64]] [--fp8-gemv-sweep]  # Llama-3.1-8B
    python -m bench.kernel_table --out $OUT --no-table --gemv-sweep --gemv-model qwen3-30b-a3b  # its dense GEMVs
    python -m bench.kernel_table --out $OUT --no-table --moe [--moe-tiles 16,64,64,4,2;...] [--moe-tokens 1,8]
        [--moe-gemv-sweep]  # Qwen3-30B-A3B's MoE

The sweeps time one kernel over its options: the decode kernel by tile at small batches and by split count at large
ones; the model's projections on cuBLAS and on kernels/gemv.py by tile and split count (gemv_sweep, whose fastest
tiles gemv_tuning turns into that module's TUNED table). --moe times the fused MoE layer (kernels/fused_moe.py) on
Qwen3-30B-A3B's expert shapes, by token count and, with --moe-tiles, by tile; --moe-gemv-sweep adds the decode
path (kernels/moe_gemv.py) by tile, the router's logits at one token and its top-k by warps.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton

from bench.timing import copy_bandwidth, graph_of, time_gpu

BYTES_PER_GRAPH = 256 << 20  # a row's calls touch about this much together (five times the H200's 50 MB L2)
MAX_CALLS = 64
FP8 = torch.float8_e4m3fn

Call = Callable[[], object]
Timer = Callable[[list[Call]], float]


@dataclass(frozen=True)
class Shapes:
    """A model's shapes and the rows to measure on them."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    page_size: int
    decode: tuple  # (batch, context) of the decode attention rows
    tokens: tuple  # tokens per call of the per-token kernels' rows
    extend: tuple  # (sequences, new tokens each) of the extend attention rows
    argmax_rows: tuple


@dataclass(frozen=True)
class MoeShapes:
    """A mixture-of-experts layer's shapes and the token counts to measure it at."""
    hidden: int
    inter: int  # each expert's SwiGLU width
    num_experts: int
    top_k: int
    tokens: tuple


QWEN3_30B_A3B = MoeShapes(hidden=2048, inter=768, num_experts=128, top_k=8, tokens=(1, 8, 64, 256, 2048))


LLAMA3_8B = Shapes(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256, page_size=16,
                   decode=((1, 640), (1, 4096), (8, 640), (64, 2048), (128, 640), (256, 1504), (384, 1504)),
                   tokens=(1, 256, 4096), extend=((4, 512), (1, 2048)), argmax_rows=(1, 128))
# Qwen3-30B-A3B's dense projections (q/k/v, o, the LM head; inter 0: no dense MLP, its experts are moe_rows')
QWEN3_30B_A3B_DENSE = Shapes(hidden=2048, heads=32, kv_heads=4, head_dim=128, inter=0, vocab=151936, page_size=16,
                             decode=(), tokens=(), extend=(), argmax_rows=())


def graph_timer(calls: list[Call]) -> float:
    """Seconds per call: all the calls captured in one CUDA graph, whose replay is timed by do_bench (median; L2
    flushed before each replay)."""
    graph = graph_of(lambda: [call() for call in calls])
    return time_gpu(graph.replay, warmup=10, rep=100) / len(calls)


def eager_timer(calls: list[Call]) -> float:
    """Seconds per call, launched one by one: for the CPU (Triton's interpreter), where only the rows' plumbing and
    errors mean anything."""
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


@triton.jit
def _empty_kernel(x_ptr):
    pass


class Table:
    """The rows, measured in turn. build(i) → (call, error) gives copy i's call over inputs of its own; error (used
    for copy 0 only) runs that call once and returns its error against the reference."""

    def __init__(self, shapes: Shapes | None, timer: Timer, max_calls: int, copy_tbs: float | None, device: str,
                 dtype: torch.dtype) -> None:
        self.s, self.timer, self.max_calls, self.copy_tbs, self.dev = shapes, timer, max_calls, copy_tbs, device
        self.dtype, self.esize = dtype, dtype.itemsize  # the activations'
        self.rows: dict[str, dict] = {}
        # the CPU's (the interpreter's) few multiprocessors keep its split counts, and so its runs, small
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4

    def measure(self, name: str, num_bytes: int, build: Callable[[int], tuple[Call, Callable[[], float]]],
                flops: float = 0.0, **extra) -> dict:
        calls = max(2, min(self.max_calls, -(-BYTES_PER_GRAPH // max(1, num_bytes))))
        torch.manual_seed(0)
        first, error = build(0)
        err = error()
        copies = [first]
        for i in range(1, calls):
            torch.manual_seed(i)
            copies.append(build(i)[0])
        seconds = self.timer(copies)
        row = {"us": round(seconds * 1e6, 2), "bytes": num_bytes, "calls": calls, "rel_err": float(f"{err:.3g}"),
               **extra}
        if num_bytes:
            row["tb_s"] = round(num_bytes / seconds / 1e12, 3)
            if self.copy_tbs:
                row["of_copy"] = round(num_bytes / seconds / 1e12 / self.copy_tbs, 3)
        if flops:
            row["tflops"] = round(flops / seconds / 1e12, 1)
        self.rows[name] = row
        del copies, first
        if self.dev == "cuda":
            torch.cuda.empty_cache()
        return row

    def randn(self, *shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(shape, device=self.dev).to(dtype or self.dtype)

    def cache_name(self, cache_dtype: torch.dtype) -> str:
        return {FP8: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[cache_dtype]

    def inv_freq(self) -> torch.Tensor:
        from services.gpu_worker.model.presets import preset
        from services.gpu_worker.model.rope import inv_frequencies

        return inv_frequencies(self.s.head_dim, 500000.0, preset("llama3-8b").rope_scaling).to(self.dev)

    def paged_cache(self, num_pages: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random K and V caches [P, S, KVH, D]."""
        shape = (num_pages, self.s.page_size, self.s.kv_heads, self.s.head_dim)
        return self.randn(*shape, dtype=dtype), self.randn(*shape, dtype=dtype)

    def new_qkv(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Un-rotated q, k, v of `tokens` new tokens: views of one fused projection, as the model passes them."""
        s = self.s
        qkv = self.randn(tokens, s.heads + 2 * s.kv_heads, s.head_dim)
        return qkv[:, :s.heads], qkv[:, s.heads:s.heads + s.kv_heads], qkv[:, s.heads + s.kv_heads:]

    @staticmethod
    def reference_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots) -> tuple:
        """What the fused RoPE + KV-write kernels must leave: rope_ref's q, and copies of the caches with rope_ref's k
        and v written at `slots` → (q, k_cache, v_cache)."""
        from services.gpu_worker.kernels.rope import rope_ref
        from services.gpu_worker.kv_cache import write_slots

        rq, rk = rope_ref(q, k, positions, inv_freq)
        kc, vc = k_cache.clone(), v_cache.clone()
        write_slots(kc, vc, slots.long(), rk, v)
        return rq, kc, vc

    # --- the rows ---------------------------------------------------------------------------------------------

    def empty(self) -> None:
        x = torch.zeros(1, device=self.dev)
        self.measure("empty", 0, lambda i: (lambda: _empty_kernel[(1,)](x), lambda: 0.0))

    def decode(self, batch: int, context: int, cache_dtype: torch.dtype, tile: tuple | None = None,
               splits: int | None = None) -> None:
        """The engine's decode step: decode_attention_rope (RoPE of the new token's q and k, its k and v written
        into the cache, attention over the `context` keys, split-K with its reduce where the batch is small).
        tile, splits: the split kernel's tile and split count (where None, decode_attention.default_tile's and
        num_splits_for's; where given, named in the row's key)."""
        from services.gpu_worker.kernels.decode_attention import (decode_attention_ref, decode_attention_rope,
                                                                  num_splits_for, tile_name)
        from services.gpu_worker.kv_cache import v_rows

        s = self.s
        name = (f"decode_{self.cache_name(cache_dtype)}_B{batch}_L{context}" + (f"_{tile_name(tile)}" if tile else "")
                + (f"_{splits}splits" if splits else ""))
        splits = splits or num_splits_for(batch, s.kv_heads, self.num_sms)
        per_seq = -(-context // s.page_size)
        esize = cache_dtype.itemsize

        def build(i: int):
            num_pages = batch * per_seq + 1
            k_cache, v_cache = self.paged_cache(num_pages, cache_dtype)
            table = (torch.randperm(num_pages - 1, device=self.dev)[:batch * per_seq] + 1).to(torch.int32)
            table = table.view(batch, per_seq)
            lens = torch.full((batch,), context, dtype=torch.int32, device=self.dev)
            positions = lens - 1
            slots = (table.gather(1, (positions // s.page_size).long()[:, None])[:, 0] * s.page_size
                     + positions % s.page_size)
            q, k, v = self.new_qkv(batch)
            inv_freq = self.inv_freq()
            out = torch.empty_like(q)

            def call():
                decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens, splits,
                                      out=out, tile=tile)

            def error() -> float:
                rq, kc, vc = self.reference_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots)
                ref = decode_attention_ref(rq, kc.float(), v_rows(vc).float(), table, lens)
                call()
                return rel_err(out, ref)

            return call, error

        kv_bytes = batch * context * s.kv_heads * s.head_dim * 2 * esize
        qkv_out_bytes = batch * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * self.esize
        self.measure(name, kv_bytes + qkv_out_bytes, build, splits=splits)

    def extend(self, num_seqs: int, new_tokens: int) -> None:
        """Prefill attention: `new_tokens` causal queries per sequence over its keys, no cached prefix."""
        from services.gpu_worker.kernels.extend_attention import extend_attention, extend_attention_ref

        s = self.s
        per_seq = -(-new_tokens // s.page_size)

        def build(i: int):
            k_cache, v_cache = self.paged_cache(num_seqs * per_seq + 1)
            table = (torch.arange(num_seqs * per_seq, device=self.dev, dtype=torch.int32) + 1).view(num_seqs, -1)
            lens = torch.full((num_seqs,), new_tokens, dtype=torch.int32, device=self.dev)
            starts = torch.arange(num_seqs + 1, device=self.dev, dtype=torch.int32) * new_tokens
            q = self.randn(num_seqs * new_tokens, s.heads, s.head_dim)
            out = torch.empty_like(q)

            def call():
                extend_attention(q, k_cache, v_cache, starts, lens, table, new_tokens, out=out)

            def error() -> float:
                call()
                return rel_err(out, extend_attention_ref(q, k_cache, v_cache, starts, lens, table))

            return call, error

        flops = num_seqs * s.heads * 4 * s.head_dim * new_tokens * new_tokens / 2  # causal; QK and PV
        num_bytes = num_seqs * new_tokens * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * self.esize
        self.measure(f"extend_{num_seqs}x{new_tokens}", num_bytes, build, flops=flops)

    def rms_norm(self, tokens: int, parts: int) -> None:
        """RMSNorm after the residual add; parts > 1: of the split-K projection's fp32 partials (batches ≤ 32)."""
        from services.gpu_worker.kernels.rms_norm import rms_norm, rms_norm_ref

        h = self.s.hidden

        def build(i: int):
            x = (self.randn(parts, tokens, h, dtype=torch.float32) if parts > 1 else self.randn(tokens, h))
            r, w = self.randn(tokens, h), self.randn(h)

            def call():
                return rms_norm(x, w, 1e-5, r)

            def error() -> float:
                (y, res), (ry, rres) = call(), rms_norm_ref(x, w, 1e-5, r)
                return max(rel_err(y, ry), rel_err(res, rres))

            return call, error

        x_bytes = parts * tokens * h * 4 if parts > 1 else tokens * h * self.esize
        name = f"rms_norm_T{tokens}" + (f"_{parts}_partials" if parts > 1 else "")
        self.measure(name, x_bytes + 3 * tokens * h * self.esize, build)

    def rope_kv_write(self, tokens: int, cache_dtype: torch.dtype) -> None:
        """A prefill chunk's RoPE and KV write: q rotated in place, rotated k and v into their cache slots."""
        from services.gpu_worker.kernels.rope_kv_write import rope_kv_write_
        from services.gpu_worker.kv_cache import v_rows

        s = self.s
        esize = cache_dtype.itemsize

        def build(i: int):
            k_cache, v_cache = self.paged_cache(-(-tokens // s.page_size) + 1, cache_dtype)
            slots = (torch.randperm(tokens, device=self.dev) + s.page_size).to(torch.int32)
            positions = torch.randint(0, 8192, (tokens,), device=self.dev, dtype=torch.int32)
            q, k, v = self.new_qkv(tokens)
            inv_freq = self.inv_freq()

            def call():
                rope_kv_write_(q, k, v, positions, inv_freq, k_cache, v_cache, slots)

            def error() -> float:
                rq, kc, vc = self.reference_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots)
                call()
                return max(rel_err(q, rq), rel_err(k_cache.float(), kc.float()),
                           rel_err(v_rows(v_cache).float(), v_rows(vc).float()))

            return call, error

        num_bytes = tokens * s.head_dim * ((2 * s.heads + 2 * s.kv_heads) * self.esize + 2 * s.kv_heads * esize)
        self.measure(f"rope_kv_write_{self.cache_name(cache_dtype)}_T{tokens}", num_bytes, build)

    def silu_mul(self, tokens: int) -> None:
        from services.gpu_worker.kernels.silu_mul import silu_mul, silu_mul_ref

        def build(i: int):
            x = self.randn(tokens, 2 * self.s.inter)
            return (lambda: silu_mul(x)), (lambda: rel_err(silu_mul(x), silu_mul_ref(x)))

        self.measure(f"silu_mul_T{tokens}", 3 * tokens * self.s.inter * self.esize, build)

    def argmax(self, rows: int) -> None:
        """The graph's greedy pick over fp32 logits."""
        from services.gpu_worker.kernels.argmax import argmax_rows, argmax_rows_ref

        def build(i: int):
            logits = self.randn(rows, self.s.vocab, dtype=torch.float32)
            out = torch.empty(rows, dtype=torch.int64, device=self.dev)

            def error() -> float:
                argmax_rows(logits, out=out)
                return float((out != argmax_rows_ref(logits)).float().mean())

            return (lambda: argmax_rows(logits, out=out)), error

        self.measure(f"argmax_{rows}x{self.s.vocab}", rows * self.s.vocab * 4, build)

    def embedding(self, tokens: int, weight: torch.Tensor) -> None:
        """The graph's first kernel: each token's row of the embedding table (one table for every call)."""
        from services.gpu_worker.kernels.embedding import embedding_fed, embedding_fed_ref

        def build(i: int):
            ids = torch.randint(0, self.s.vocab, (tokens,), device=self.dev, dtype=torch.int32)
            src = torch.full((tokens,), -1, device=self.dev, dtype=torch.int32)
            prev = torch.zeros(1, device=self.dev, dtype=torch.int64)
            return ((lambda: embedding_fed(weight, ids, src, prev)),
                    (lambda: rel_err(embedding_fed(weight, ids, src, prev), embedding_fed_ref(weight, ids, src, prev))))

        self.measure(f"embedding_T{tokens}", 2 * tokens * self.s.hidden * self.esize, build)

    def moe(self, m: MoeShapes, tokens: int, tile: tuple | None = None, gemv: tuple | None = None,
            torch_align: bool = False) -> dict:
        """The MoE layer's experts over a random routing of `tokens` tokens, each call with weights and a routing of
        its own: with `tile` (MoeTile fields) the sort and grouped GEMM (fused_moe with gemv_max_tokens 0); with
        `gemv` (a (gate_up, down) pair of GemvTile fields) kernels/moe_gemv.py; with neither, as served (fused_moe's
        defaults); torch_align: the pairs sorted by align_by_expert's torch ops, not the kernels (the A/B of
        align_chunked). Bytes: x, the output and the weights of the experts hit (their expected number,
        E·(1 − (1 − k/E)^T) for k distinct experts a token drawn at random)."""
        from services.gpu_worker.kernels import fused_moe as fm
        from services.gpu_worker.kernels import moe_gemv as mg

        cfg = None if tile is None else fm.MoeTile(*tile)
        gemv_cfg = None if gemv is None else mg.MoeGemvConfig(*(mg.GemvTile(*g) for g in gemv))

        def build(i: int):
            gate_up = self.randn(m.num_experts, 2 * m.inter, m.hidden) * m.hidden ** -0.5  # [E, 2I, H]
            down = self.randn(m.num_experts, m.hidden, m.inter) * m.inter ** -0.5  # [E, H, I]
            x = self.randn(tokens, m.hidden)
            weights, ids = torch.rand(tokens, m.num_experts, device=self.dev).topk(m.top_k)  # [T, k] each
            if gemv_cfg is not None:
                call = lambda: mg.moe_gemv(x, gate_up, down, ids, weights, gemv_cfg)  # noqa: E731
            elif cfg is not None:
                call = lambda: fm.fused_moe(x, gate_up, down, ids, weights, tile=cfg, gemv_max_tokens=0,  # noqa: E731
                                            torch_align=torch_align)
            else:
                call = lambda: fm.fused_moe(x, gate_up, down, ids, weights)  # noqa: E731
            return call, (lambda: rel_err(call(), fm.fused_moe_ref(x, gate_up, down, ids, weights)))

        hit = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** tokens)
        num_bytes = round(hit * 3 * m.hidden * m.inter * self.esize) + 2 * tokens * m.hidden * self.esize
        if gemv is not None:
            label = "_gemv_{}x{}w{}s{}_{}x{}w{}s{}".format(*gemv_cfg.gate_up, *gemv_cfg.down)
        else:
            label = "" if tile is None else "_{}x{}x{}w{}s{}".format(*cfg)
            label += "_torchsort" if torch_align else ""
        return self.measure(f"moe_E{m.num_experts}_k{m.top_k}_T{tokens}{label}", num_bytes, build,
                            flops=2 * tokens * m.top_k * 3 * m.hidden * m.inter)

    def route(self, m: MoeShapes, tokens: int, num_warps: int) -> dict:
        """The router's top-k (kernels/moe_routing.route_topk) over [tokens, E] fp32 logits with num_warps warps a
        program. Bytes: the logits read, the ids and weights written."""
        from services.gpu_worker.kernels.moe_routing import route_topk, route_topk_ref

        def build(i: int):
            logits = torch.randn(tokens, m.num_experts, device=self.dev)
            call = lambda: route_topk(logits, m.top_k, True, num_warps)  # noqa: E731
            return call, (lambda: rel_err(call()[1], route_topk_ref(logits, m.top_k, True)[1]))

        return self.measure(f"route_topk_T{tokens}_w{num_warps}", tokens * (m.num_experts + 3 * m.top_k) * 4, build)

    def gemv(self, name: str, tokens: int, n: int, k: int, parts: int, config: tuple | None = None,
             fp8: bool = False) -> dict:
        """x [tokens, k] @ w [n, k]ᵀ: on the Triton GEMV with `config` (kernels/gemv.py; parts > 1: fp32 partials), or
        with config None on cuBLAS the way model/fused.py calls it (F.linear; parts > 1: its split-K bmm). fp8: w in
        e4m3 with a float32 scale a row (W8A16, as quant/fp8.py serves one token), on the GEMV only."""
        import torch.nn.functional as F

        from services.gpu_worker.kernels import gemv as g
        from services.gpu_worker.model import fused

        cfg = None if config is None else g.GemvConfig(*config)
        if fp8:
            return self._gemv_fp8(name, tokens, n, k, cfg)

        def build(i: int):
            x, w = self.randn(tokens, k), self.randn(n, k) * k ** -0.5
            if cfg is None:
                call = (lambda: F.linear(x, w)) if parts == 1 else (lambda: fused._row_projection(x, w, parts, False))
            else:
                call = lambda: g.gemv(x, w, parts=parts, config=cfg)  # noqa: E731
            return call, (lambda: rel_err(call(), g.gemv_ref(x, w, parts=parts)))

        out_bytes = parts * tokens * n * 4 if parts > 1 else tokens * n * self.esize
        label = "cublas" if config is None else "{}x{}w{}s{}".format(*config)
        return self.measure(f"gemv_{name}_M{tokens}_p{parts}_{label}", (n + tokens) * k * self.esize + out_bytes,
                            build)

    def _gemv_fp8(self, name: str, tokens: int, n: int, k: int, cfg) -> dict:
        from services.gpu_worker.kernels import gemv as g
        from services.gpu_worker.quant.fp8 import quantize_weight_fp8

        def build(i: int):
            x = self.randn(tokens, k)
            w8, scale = quantize_weight_fp8(self.randn(n, k) * k ** -0.5)
            call = lambda: g.gemv(x, w8, config=cfg, scale=scale.float())  # noqa: E731
            return call, (lambda: rel_err(call(), g.gemv_ref(x, w8, scale=scale.float())))

        label = "default" if cfg is None else "{}x{}w{}s{}".format(*cfg)
        return self.measure(f"gemv8_{name}_M{tokens}_{label}", n * k + 4 * n + tokens * (n + k) * self.esize, build)

    def w4a16(self, name: str, tokens: int, n: int, k: int, config: tuple | str | None = None,
              group_size: int = 128) -> dict:
        """x [tokens, k] @ Wᵀ with W [n, k] as INT4 (kernels/w4a16.py's layout, groups of group_size) on the W4A16
        kernel with `config` (W4A16Config fields; None: as served, w4a16_linear; "dequant": the large-M path at any
        M, w4a16_dequantize then cuBLAS)."""
        import torch.nn.functional as F

        from services.gpu_worker.kernels import w4a16 as w4

        cfg = None if config is None or config == "dequant" else w4.W4A16Config(*config)

        def build(i: int):
            x = self.randn(tokens, k)
            qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // w4.PACK), dtype=torch.int32, device=self.dev)
            scales = (torch.rand(n, k // group_size, device=self.dev) * 0.02).to(self.dtype)
            zeros = torch.randint(0, 16, (n, k // group_size), device=self.dev).to(self.dtype)
            if config == "dequant":
                def call():
                    return F.linear(x, w4.w4a16_dequantize(qweight, scales, zeros, group_size, x.dtype))
            elif cfg is None:  # as served: the path and tile w4a16_linear picks
                call = lambda: w4.w4a16_linear(x, qweight, scales, zeros, group_size)  # noqa: E731
            else:
                call = lambda: w4.w4a16_matmul(x, qweight, scales, zeros, group_size, config=cfg)  # noqa: E731

            def error() -> float:
                ref = x.float() @ w4.dequantize_reference(qweight, scales, zeros, group_size).float().t()
                return rel_err(call(), ref)
            return call, error

        num_bytes = n * k // 2 + 2 * n * (k // group_size) * self.esize + tokens * (n + k) * self.esize
        label = "default" if config is None else config if isinstance(config, str) else "{}x{}x{}w{}s{}".format(*cfg)
        return self.measure(f"w4a16_{name}_M{tokens}_{label}", num_bytes, build)


def table(shapes: Shapes = LLAMA3_8B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
          copy_tbs: float | None = None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Every row of `shapes`, in order: {name: row}. dtype: the activations' and the plain cache's (the CPU's
    interpreter runs fp32)."""
    t = Table(shapes, timer, max_calls, copy_tbs, device, dtype)
    t.empty()
    for cache_dtype in (dtype, FP8):
        for batch, context in shapes.decode:
            t.decode(batch, context, cache_dtype)
    for num_seqs, new_tokens in shapes.extend:
        t.extend(num_seqs, new_tokens)
    weight = t.randn(shapes.vocab, shapes.hidden)
    for tokens in shapes.tokens:
        t.rms_norm(tokens, 1)
        if tokens <= 32:
            t.rms_norm(tokens, 4)
        for cache_dtype in (dtype, FP8):
            t.rope_kv_write(tokens, cache_dtype)
        t.silu_mul(tokens)
        t.embedding(tokens, weight)
    for rows in shapes.argmax_rows:
        t.argmax(rows)
    return t.rows


# The split kernel's tile for launches of many splits (small batches), where a split covers few keys: a sequence's
# keys are cut into chunks of whole tiles, so at 640 keys and 32 splits a 64-key tile leaves 22 splits empty and a
# 128-key one (the FP8 default) 27. (keys, warps, stages, fp16 dots, register cap, assembly unpacking)
SWEEP_SHAPES = ((1, 640), (1, 1024), (1, 4096), (4, 640), (8, 640), (8, 2048), (16, 1504))
SWEEP_TILES = {torch.bfloat16: ((16, 2, 2, False, 0, False), (16, 4, 2, False, 0, False), (32, 2, 2, False, 0, False),
                                (32, 4, 2, False, 0, False), (64, 4, 2, False, 0, False)),
               FP8: ((32, 2, 2, True, 0, True), (32, 4, 2, True, 0, True), (64, 4, 2, True, 0, True),
                     (128, 4, 2, True, 0, True))}


def tile_sweep(shapes: Shapes = LLAMA3_8B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
               copy_tbs: float | None = None, device: str = "cuda", sweep_shapes: tuple = SWEEP_SHAPES,
               tiles: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The decode rows of `sweep_shapes` with each tile of `tiles` (SWEEP_TILES': cache dtype → tiles); dtype: the
    activations'."""
    t = Table(shapes, timer, max_calls, copy_tbs, device, dtype)
    for cache_dtype, dtype_tiles in (tiles or SWEEP_TILES).items():
        for batch, context in sweep_shapes:
            for tile in dtype_tiles:
                t.decode(batch, context, cache_dtype, tile)
    return t.rows


# The split count at the batches where num_splits_for gives one split (W0's 128 sequences, W1's 384-512): more
# programs per sequence, shorter loops, against the reduce kernel's launch and the partials' bytes.
SPLIT_SHAPES = ((64, 2048), (128, 640), (128, 1024), (256, 1504), (512, 1504))
SPLIT_COUNTS = (1, 2, 4)


def split_sweep(shapes: Shapes = LLAMA3_8B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
                copy_tbs: float | None = None, device: str = "cuda", sweep_shapes: tuple = SPLIT_SHAPES,
                counts: tuple = SPLIT_COUNTS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The decode rows of `sweep_shapes` by split count, with each cache dtype's default tile."""
    t = Table(shapes, timer, max_calls, copy_tbs, device, dtype)
    for cache_dtype in (dtype, FP8):
        for batch, context in sweep_shapes:
            for splits in counts:
                t.decode(batch, context, cache_dtype, splits=splits)
    return t.rows


def gemv_shapes(s: Shapes) -> tuple:
    """(name, N, K, split-K part counts) of the model's projections at decode: the row-parallel o and down as the
    next RMSNorm takes them (fp32 partials, or whole rows at 1 part)."""
    mlp = (("gate_up", 2 * s.inter, s.hidden, (1,)), ("down", s.hidden, s.inter, (1, 2, 4, 8))) if s.inter else ()
    return (("qkv", (s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, (1,)),
            ("o", s.hidden, s.heads * s.head_dim, (1, 2, 4, 8)), *mlp, ("lm_head", s.vocab, s.hidden, (1,)))


def gemv_tiles(tokens: int) -> tuple:
    """GemvConfig fields (block_n, block_k, num_warps, num_stages) to try: the one-row kernel, or the dot kernel."""
    if tokens == 1:
        return tuple((bn, bk, w, st) for bn in (8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8) for st in (1, 3))
    return tuple((bn, bk, w, 1) for bn in (16, 32, 64) for bk in (128, 256) for w in (4, 8))


def gemv_tiles_wide(tokens: int) -> tuple:
    """The one-row kernel over a wider grid than gemv_tiles' (4 to 32 rows, 256 to 2048 columns, 2 to 16 warps);
    the dot kernel's tiles as gemv_tiles'."""
    if tokens == 1:
        return tuple((bn, bk, w, 1) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024, 2048) for w in (2, 4, 8, 16))
    return gemv_tiles(tokens)


def gemv_tiles_narrow(tokens: int) -> tuple:
    """One token, few rows a program (1 to 8) by 512 to 4096 columns, one or two stages: the region where the MoE
    GEMV's best tile (4 x 512, two stages) and kernels/gemv.py's TUNED tiles (2 x 4096) lie; K = 2048 models."""
    if tokens == 1:
        return tuple((bn, bk, 4, st) for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048, 4096) for st in (1, 2))
    return gemv_tiles(tokens)


def gemv_sweep(shapes: Shapes = LLAMA3_8B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
               copy_tbs: float | None = None, device: str = "cuda", tokens: tuple = (1, 8),
               tiles: Callable[[int], tuple] = gemv_tiles, dtype: torch.dtype = torch.bfloat16,
               max_parts: int = 8) -> dict:
    """Each projection of `shapes` at each token count and split count: on cuBLAS, and on the Triton GEMV with each
    tile of tiles(tokens) no wider than a part; split counts up to max_parts. → {"rows": every row, "best": per (projection, tokens, parts) the
    fastest tile, its µs and fraction of copy, and cuBLAS's µs}."""
    t = Table(shapes, timer, max_calls, copy_tbs, device, dtype)
    best = {}
    for name, n, k, counts in gemv_shapes(shapes):
        for m in tokens:
            for parts in (c for c in counts if c <= max_parts):
                base = t.gemv(name, m, n, k, parts)
                tried = {cfg: t.gemv(name, m, n, k, parts, cfg) for cfg in tiles(m) if cfg[1] <= k // parts}
                if not tried:
                    continue
                cfg = min(tried, key=lambda c: tried[c]["us"])
                best[f"{name}_M{m}_p{parts}"] = {
                    "n": n, "k": k, "tokens": m, "parts": parts, "config": list(cfg), "us": tried[cfg]["us"],
                    "of_copy": tried[cfg].get("of_copy"), "cublas_us": base["us"],
                    "cublas_of_copy": base.get("of_copy"), "over_cublas": round(tried[cfg]["us"] / base["us"], 3)}
    return {"rows": t.rows, "best": best}


FP8_GEMV_TILES = tuple((bn, bk, w, 1) for bn in (1, 2, 4, 8) for bk in (1024, 2048, 4096, 8192) for w in (4, 8))


def fp8_gemv_sweep(shapes: Shapes = LLAMA3_8B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
                   copy_tbs: float | None = None, device: str = "cuda", tiles: tuple = FP8_GEMV_TILES,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each projection but the LM head (quantization leaves it alone) at one token with e4m3 weights on the Triton
    GEMV: at config_for's tile (TUNED_FP8's, else the bf16 one) and each of `tiles` no wider than K → {"rows",
    "best": per projection the fastest tile, its µs and fraction of copy, and the default tile's µs}: gemv.TUNED_FP8's
    entries."""
    t = Table(shapes, timer, max_calls, copy_tbs, device, dtype)
    best = {}
    for name, n, k, _ in gemv_shapes(shapes):
        if name == "lm_head":
            continue
        default = t.gemv(name, 1, n, k, 1, fp8=True)
        tried = {cfg: t.gemv(name, 1, n, k, 1, cfg, fp8=True) for cfg in tiles if cfg[1] <= k}
        cfg = min(tried, key=lambda c: tried[c]["us"])
        best[name] = {"n": n, "k": k, "config": list(cfg), "us": tried[cfg]["us"], "of_copy": tried[cfg].get("of_copy"),
                      "default_us": default["us"], "default_of_copy": default.get("of_copy")}
    return {"rows": t.rows, "best": best}


# One token: rows x columns x warps. The kernel reaches 0.29-0.41 of copy with issue slots to spare (~0.84 ms of
# instructions a batch-1 step against 3.4 ms), so loads in flight are the suspect; narrower tiles (fewer registers a
# thread, more warps an SM) are swept. (A register prefetch of the next step's loads lost at every tile: removed.)
W4A16_TILES = tuple((1, bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8))
W4A16_TOKENS = (8, 32, 64, 128, 256)  # the sweep's multi-token rows: decode batches and a prefill chunk


def w4a16_sweep(shapes: Shapes = LLAMA3_8B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
                copy_tbs: float | None = None, device: str = "cuda", tiles: tuple = W4A16_TILES,
                dtype: torch.dtype = torch.bfloat16, group_size: int = 128, tokens: tuple = W4A16_TOKENS) -> dict:
    """Each projection of `shapes` at one token on the INT4 kernel (kernels/w4a16.py): at config_for's tile and at
    each of `tiles` no wider than K, beside
    the bf16 weights on cuBLAS → {"rows", "best": per projection the fastest tile, its µs and fraction of copy, the
    default tile's µs and cuBLAS bf16's µs; "tokens": at each of W4A16_TOKENS, the default path as served, the
    dequantizing dot tile, dequantize-then-cuBLAS and bf16 cuBLAS}: where to set w4a16.DEQUANT_MIN_TOKENS."""
    from services.gpu_worker.kernels import w4a16 as w4

    t = Table(shapes, timer, max_calls, copy_tbs, device, dtype)
    best = {}
    for name, n, k, _ in gemv_shapes(shapes):
        if name == "lm_head":  # served dense (quantization leaves the LM head alone)
            continue
        dense = t.gemv(name, 1, n, k, 1)
        default = t.w4a16(name, 1, n, k, group_size=group_size)
        tried = {cfg: t.w4a16(name, 1, n, k, cfg, group_size) for cfg in tiles if cfg[2] <= k}
        cfg = min(tried, key=lambda c: tried[c]["us"])
        best[name] = {"n": n, "k": k, "config": list(cfg), "us": tried[cfg]["us"], "of_copy": tried[cfg].get("of_copy"),
                      "default_us": default["us"], "bf16_cublas_us": dense["us"]}
    batches = {}  # several tokens: the default (the group kernel for groups of 128) against the dequantizing tile
    for m in tokens:
        for name, n, k, _ in gemv_shapes(shapes):
            if name == "lm_head":
                continue
            dense = t.gemv(name, m, n, k, 1)
            default = t.w4a16(name, m, n, k, group_size=group_size)
            dequant = t.w4a16(name, m, n, k, tuple(w4.config_for(m, n, k)), group_size)
            cublas = t.w4a16(name, m, n, k, "dequant", group_size)
            batches[f"{name}_M{m}"] = {"default_us": default["us"], "dequant_tile_us": dequant["us"],
                                           "dequant_cublas_us": cublas["us"], "bf16_cublas_us": dense["us"],
                                           "default_over_bf16": round(default["us"] / dense["us"], 3)}
    return {"rows": t.rows, "best": best, "tokens": batches}


def gemv_tuning(best: dict, tokens: int = 1) -> tuple[dict, int]:
    """gemv_sweep's "best" → (kernels/gemv.TUNED entries for `tokens`: each shape's fastest tile; ROW_PARTS: the split
    count at which o's and down's fastest tiles sum to the least time)."""
    from services.gpu_worker.kernels import gemv as g

    mine = {key: b for key, b in best.items() if b["tokens"] == tokens}
    tuned = {(b["n"], b["k"], b["parts"], g.m_bucket(tokens)): g.GemvConfig(*b["config"]) for b in mine.values()}
    counts = sorted({b["parts"] for key, b in mine.items() if key.startswith(("o_", "down_"))})

    def row_time(parts: int) -> float:
        return sum(mine[key]["us"] for key in (f"o_M{tokens}_p{parts}", f"down_M{tokens}_p{parts}") if key in mine)

    return tuned, (min(counts, key=row_time) if counts else g.ROW_PARTS)


# kernels/moe_gemv.py's tiles, swept one kernel at a time around its default (the other kernel at its default)
MOE_GEMV_GATE_UP = ((1, 2048, 4, 1), (2, 2048, 4, 1), (4, 2048, 4, 1), (2, 2048, 8, 1), (2, 1024, 4, 1),
                    (4, 1024, 4, 1), (8, 512, 4, 1), (4, 512, 4, 2))
MOE_GEMV_DOWN = ((1, 256, 4, 1), (2, 256, 4, 1), (4, 256, 4, 1), (2, 128, 4, 1), (4, 128, 4, 1), (4, 256, 8, 1),
                 (8, 128, 8, 1), (2, 512, 8, 1))


def moe_rows(shapes: MoeShapes = QWEN3_30B_A3B, timer: Timer = graph_timer, max_calls: int = MAX_CALLS,
             copy_tbs: float | None = None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
             tiles: tuple = (None,), tokens: tuple | None = None, gemv_sweep: bool = False,
             gemv_max_tokens: int = 16, torch_align: bool = False) -> dict:
    """The MoE experts at each of `tokens` (shapes.tokens), with each tile (MoeTile fields; None: as served); with
    gemv_sweep also, up to gemv_max_tokens tokens, kernels/moe_gemv.py by tile (MOE_GEMV_GATE_UP with down's default
    tile, MOE_GEMV_DOWN with gate_up's), at one token the router's logits on cuBLAS and on kernels/gemv.py, and the
    router's top-k at 1, 64 and 256 tokens on 1, 2 and 4 warps; with
    torch_align also each given tile with the torch sort, past fused_moe.SMALL_PAIRS pairs."""
    from services.gpu_worker.kernels import fused_moe as fm
    from services.gpu_worker.kernels import moe_gemv as mg

    t = Table(None, timer, max_calls, copy_tbs, device, dtype)
    base = mg.default_config(shapes.hidden, shapes.inter)
    for m in tokens or shapes.tokens:
        for tile in tiles:
            t.moe(shapes, m, tile)
            if torch_align and tile is not None and m * shapes.top_k > fm.SMALL_PAIRS:
                t.moe(shapes, m, tile, torch_align=True)
        if gemv_sweep and m <= gemv_max_tokens:
            combos = [(g, tuple(base.down)) for g in MOE_GEMV_GATE_UP] + \
                [(tuple(base.gate_up), d) for d in MOE_GEMV_DOWN if d != tuple(base.down)]
            for combo in dict.fromkeys(combos):
                t.moe(shapes, m, gemv=combo)
    if gemv_sweep:
        t.gemv("router", 1, shapes.num_experts, shapes.hidden, 1)
        for cfg in ((2, 2048, 4, 1), (1, 2048, 4, 1), (4, 1024, 4, 1)):
            t.gemv("router", 1, shapes.num_experts, shapes.hidden, 1, cfg)
        for m in (1, 64, 256):
            for warps in (1, 2, 4):
                t.route(shapes, m, warps)
    return t.rows


def markdown(rows: dict) -> str:
    lines = ["| kernel | µs per call | TB/s | of copy | TFLOP/s | error |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['us']} | {r.get('tb_s', '')} | {r.get('of_copy', '')} | {r.get('tflops', '')} "
                     f"| {r['rel_err']:.2g} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--tile-sweep", action="store_true", help="also the decode kernel by tile at small batches "
                   "(SWEEP_SHAPES x SWEEP_TILES), under the key tile_sweep")
    p.add_argument("--sweep-shapes", default="", help="--tile-sweep's batch x context list instead of SWEEP_SHAPES, "
                   "e.g. 128x640,128x1024")
    p.add_argument("--sweep-fp8-tiles", default="", help="--tile-sweep over an FP8 cache only, with these tiles "
                   "(keys,warps,stages,fp16_dots,max_regs[,asm_unpack] separated by ';') instead of SWEEP_TILES")
    p.add_argument("--split-sweep", action="store_true", help="also the decode kernel by split count at large batches "
                   "(SPLIT_SHAPES x SPLIT_COUNTS), under the key split_sweep")
    p.add_argument("--gemv-sweep", action="store_true", help="also the projections on cuBLAS and on the Triton GEMV "
                   "by tile and split count at 1 and 8 tokens (gemv_sweep), under the key gemv_sweep")
    p.add_argument("--gemv-model", choices=("llama3-8b", "qwen3-30b-a3b"), default="llama3-8b",
                   help="--gemv-sweep's shapes: Llama-3.1-8B's projections at 1 and 8 tokens and split counts, or "
                   "Qwen3-30B-A3B's dense ones (q/k/v, o, LM head) at one token, whole rows, over gemv_tiles_narrow")
    p.add_argument("--w4a16-sweep", action="store_true", help="also the projections at one token on the INT4 "
                   "kernel by tile (w4a16_sweep), under the key w4a16_sweep")
    p.add_argument("--w4a16-tokens", default="", help="--w4a16-sweep's multi-token rows at these counts "
                   "(comma-separated; 0: none) instead of W4A16_TOKENS")
    p.add_argument("--fp8-gemv-sweep", action="store_true", help="also the projections at one token with e4m3 weights "
                   "on the Triton GEMV by tile (fp8_gemv_sweep), under the key fp8_gemv_sweep")
    p.add_argument("--moe", action="store_true", help="also the fused MoE layer on Qwen3-30B-A3B's expert shapes "
                   "(moe_rows), under the key moe")
    p.add_argument("--moe-tiles", default="", help="--moe with these tiles (block_m,block_n,block_k,warps,stages "
                   "separated by ';') instead of fused_moe.default_tile")
    p.add_argument("--moe-tokens", default="", help="--moe at these token counts (comma-separated) instead of "
                   "QWEN3_30B_A3B.tokens")
    p.add_argument("--moe-gemv-sweep", action="store_true", help="--moe with kernels/moe_gemv.py by tile too, up to 16 "
                   "tokens, and the router's logits at one token on cuBLAS and on the Triton GEMV")
    p.add_argument("--moe-torch-align", action="store_true", help="--moe-tiles also with the pairs sorted by torch "
                   "ops (align_by_expert) past fused_moe.SMALL_PAIRS, the baseline of align_chunked")
    p.add_argument("--no-table", action="store_true", help="leave out the kernels' rows (with a sweep)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kernel_table needs a CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copy_tbs = copy_bandwidth()
    record = {"command": "python -m bench.kernel_table " + " ".join(sys.argv[1:]),
              "hardware": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "copy_tb_s": round(copy_tbs, 3)}
    from services.gpu_worker.kernels.decode_attention import parse_tile

    shapes = tuple(tuple(int(x) for x in shape.split("x")) for shape in args.sweep_shapes.split(",") if shape)
    fp8_tiles = tuple(parse_tile(tile) for tile in args.sweep_fp8_tiles.split(";") if tile)
    sweep = functools.partial(tile_sweep, sweep_shapes=shapes or SWEEP_SHAPES, tiles={FP8: fp8_tiles} if fp8_tiles
                              else None)
    moe_tiles = tuple(tuple(int(x) for x in tile.split(",")) for tile in args.moe_tiles.split(";") if tile)
    moe_tokens = tuple(int(x) for x in args.moe_tokens.split(",") if x) or None
    moe = functools.partial(moe_rows, tiles=moe_tiles or (None,), tokens=moe_tokens, gemv_sweep=args.moe_gemv_sweep,
                            torch_align=args.moe_torch_align)
    w4a16_tokens = tuple(int(x) for x in args.w4a16_tokens.split(",") if x and int(x) > 0)
    w4a16_run = functools.partial(w4a16_sweep, tokens=w4a16_tokens) if args.w4a16_tokens else w4a16_sweep
    if args.gemv_model == "qwen3-30b-a3b":
        gemv_sweep_run = functools.partial(gemv_sweep, QWEN3_30B_A3B_DENSE, tokens=(1,), tiles=gemv_tiles_narrow,
                                           max_parts=1)
    else:
        gemv_sweep_run = gemv_sweep
    parts = (({} if args.no_table else {"rows": table}) | ({"tile_sweep": sweep} if args.tile_sweep else {})
             | ({"split_sweep": split_sweep} if args.split_sweep else {})
             | ({"gemv_sweep": gemv_sweep_run} if args.gemv_sweep else {})
             | ({"w4a16_sweep": w4a16_run} if args.w4a16_sweep else {})
             | ({"fp8_gemv_sweep": fp8_gemv_sweep} if args.fp8_gemv_sweep else {}) | ({"moe": moe} if args.moe else {}))
    for key, run in parts.items():
        record[key] = run(copy_tbs=copy_tbs)
        (out / "kernel_table.json").write_text(json.dumps(record, indent=2))
        print(markdown(record[key]["rows"] if key.endswith("_sweep") and key not in ("tile_sweep", "split_sweep")
                       else record[key]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
