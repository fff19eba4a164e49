"""Where the decode step's GPU time goes on the H200, in one device call (issue 5's diagnosis, not a figure of
merit). Llama-3.1-8B shapes, random weights, bf16; phases 1-4 without the engine: the fused forward of
model/fused.py driven directly over a hand-built paged cache.

  1. batch 1: the captured graph's kernels under the profiler (time per kernel family, idle gaps); graph
     replay with the fused decode kernel vs the separate ones at B = 1, 128, 384;
  2. cuBLAS at M = 1 per projection shape, cuBLAS vs cuBLASLt and other call forms, as a fraction of the
     copy bandwidth;
  3. batch-1 decode attention per split count (32 layers in one graph) at 640 and 4096 tokens of context,
     plain and with RoPE + KV write inside (decode_attention_rope);
  4. two micro-batches on two streams (attention of one beside the GEMMs of the other) vs one batch, at
     B = 128, 256, 384: whole forward + LM head captured in a graph, replay time;
  5. the engine's batch-1 decode steps under the profiler (GPU work beside the graph, waits on the host), and
     an A/B of its graph captured with and without programmatic dependent launch (kernels/pdl.py);
  6. W1's shape with the decodes of mixed steps on the decode kernel vs on the extend kernel;
  7. (gemv_split) M = 1 projections through other cuBLAS call forms: transposed storage, split-K as a batched
     GEMM with bf16 or fp32 partials; (argmax) greedy argmax, torch vs kernels/argmax.py; (splitk) the
     forward's split-K o_proj/down_proj vs F.linear by batch, and one graph relaunched vs two in turn;
     (norm) RMSNorm at one token by warp count, with and without split-K partials; (pdl) the forward's graph
     replay captured with and without programmatic dependent launch, by batch, and both graphs' logits;
  8. (fp8kv) the whole forward's graph replay with the KV cache in FP8 vs bf16, by batch and context;
     (fp8tune) the decode attention over an FP8 cache by the split kernel's tile (keys, warps, stages, ...) and
     the V cache's layout (rows, or key pairs as the engine stores it);
  9. (l2pf) the whole forward's graph replay with each L2 prefetch configuration of L2PF_VARIANTS against none
     (kernels/l2_prefetch.py), by batch and context, the logits compared, the batch-1 profiles; (l2pf_engine) the
     engine's batch-1 steps with and without the fastest of them (or the default), in turn;
 10. (multistep) K = 1, 2, 4, 8 decode steps chained in one graph through the in-graph argmax, replay time per
     step; the K = 1 graph replayed between the engine's copies in and out, and the idle time between replays;
 11. (streams) the projections cut into 2 or 4 parts run at once on side streams, per projection at M = 1 and in
     the whole forward's graph replay against one GEMM each;
 12. (tiles_engine) the engine's batch-1 steps, bf16 and FP8 cache, with the graph captured under split kernel
     tiles of fewer keys, in turn (bench/kernel_table.py --tile-sweep times the kernel alone);
 13. (gemv_engine) each projection at 1 and 8 tokens on cuBLAS and on the Triton GEMV by tile and split count
     (bench/kernel_table.gemv_sweep), then the engine's batch-1 steps with the graph captured on cuBLAS, on the GEMV's
     committed tiles (kernels/gemv.TUNED) and on the sweep's fastest, in turn.
 14. (blas) each projection at 64 to 512 tokens through F.linear with torch's cuBLAS and with cuBLASLt, then W0's
     decode steps (128 sequences) with the graphs captured under each, in turn.

Phase "merge" (the decode kernel merging its own splits by an atomic ticket per sequence and KV head) ran from
commit cfe5e49, which holds it and the kernel option; both were removed after the run
(bench/results/h200_probe_20261203_k_merge.json).

    python -m bench.h200_probe --out $OUT [--phases gemv,batch1,...,multistep,streams,tiles_engine,gemv_engine,blas]

Phase 1 runs with the fused decode kernel (RoPE + KV write inside the split-K kernel) and with the separate
rope_kv_write_ and decode kernels (TritonAttention(fuse_decode=False)), in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_suite import make_engine, prompts_for, run_timed, time_gpu
from bench.kernel_table import copy_bandwidth, graph_of
from services.gpu_worker.attention.base import AttentionMetadata
from services.gpu_worker.attention.triton_backend import TritonAttention
from services.gpu_worker.kernels import l2_prefetch, pdl
from services.gpu_worker.kernels.argmax import argmax_rows
from services.gpu_worker.kernels.decode_attention import (decode_attention, decode_attention_rope, num_splits_for,
                                                           parse_tile, tile_name)
from services.gpu_worker.kernels.rms_norm import rms_norm
from services.gpu_worker.kernels.rope_kv_write import rope_kv_write_
from services.gpu_worker.kernels.silu_mul import silu_mul
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model import fused
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.presets import preset

PAGE = 16
# phase l2pf: prefetch configs (kernels/l2_prefetch.PrefetchConfig fields) timed against no prefetch at batch 1
L2PF_VARIANTS = {
    "cols4": {"mib": 4}, "cols16_1k": {"mib": 16, "chunk": 1024},
    "rows4_64k": {"mib": 4, "layout": "rows", "chunk": 65536},
    "rows8_64k": {"mib": 8, "layout": "rows", "chunk": 65536},
    "rows16_64k": {"mib": 16, "layout": "rows", "chunk": 65536},
    "rows32_64k": {"mib": 32, "layout": "rows", "chunk": 65536},
    "rows16_8k": {"mib": 16, "layout": "rows", "chunk": 8192},
    "rows16_64k_last": {"mib": 16, "layout": "rows", "chunk": 65536, "mode": "bulk_last"},
    "rows8_64k_last": {"mib": 8, "layout": "rows", "chunk": 65536, "mode": "bulk_last"},
    "o_rows32_64k": {"mib": 32, "layout": "rows", "chunk": 65536, "gemms": ("o",)},
    "mlp_rows16_64k": {"mib": 16, "layout": "rows", "chunk": 65536, "gemms": ("gate_up", "down")},
}


def bench_ms(fn) -> float:
    return time_gpu(fn, warmup=10, rep=100) * 1e3


def capture_with_logits(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn's graph (fn returns logits), replayed once, and a copy of the logits that replay left."""
    captured: dict = {}
    g = graph_of(lambda: captured.__setitem__("logits", fn()))
    g.replay()
    torch.cuda.synchronize()
    return g, captured["logits"].clone()


def replay_in_turn(graphs: dict, logits: dict, rounds: int = 3) -> tuple[dict, dict]:
    """Each graph's replay time (bench_ms), the graphs in turn, `rounds` times, against graphs["off"] → (a row of
    ms per round by label, each variant's median over off's and whether its logits equal off's; the medians)."""
    times: dict[str, list[float]] = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, g in graphs.items():
            times[label].append(bench_ms(g.replay))
    med = {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}
    row: dict = {f"{label}_ms": [round(t, 4) for t in ts] for label, ts in times.items()}
    for label in graphs:
        if label != "off":
            row[f"{label}_over_off"] = round(med[label] / med["off"], 4)
            row[f"{label}_same_logits"] = bool(torch.equal(logits["off"], logits[label]))
    return row, med


class Batch:
    """B sequences of seq_len tokens each (the last one new) over distinct pages of the cache."""

    def __init__(self, batch: int, seq_len: int, first_page: int, width: int, dev: str) -> None:
        pages = -(-seq_len // PAGE)
        table = torch.zeros((batch, width), dtype=torch.int32)
        table[:, :pages] = (torch.arange(batch * pages, dtype=torch.int32) + first_page).view(batch, pages)
        self.page_table = table.to(dev)
        pos = seq_len - 1
        self.positions = torch.full((batch,), pos, dtype=torch.int32, device=dev)
        self.slots = (self.page_table[:, pos // PAGE].long() * PAGE + pos % PAGE).to(torch.int32)
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
        self.input_ids = torch.randint(0, 1000, (batch,), dtype=torch.int32, device=dev)
        self.meta = AttentionMetadata(
            slot_mapping=self.slots, query_start=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            seq_lens=self.seq_lens, page_table=self.page_table, query_start_host=list(range(batch + 1)),
            seq_lens_host=[seq_len] * batch, max_query_len=1, max_seq_len=seq_len)
        self.num_pages = batch * pages


def split_forward(model, kv, backend, halves: list[Batch], streams: list[torch.cuda.Stream],
                  alternate: bool) -> list[torch.Tensor]:
    """fused.forward of several micro-batches, each on its own stream. alternate: their attention kernels
    take turns (micro-batch i's layer-l attention waits for micro-batch i-1's), so each one's attention
    runs beside the others' GEMMs rather than beside another attention."""
    eps, inv_freq = model.config.rms_norm_eps, model.inv_freq
    main = torch.cuda.current_stream()
    state = []
    for mb, s in zip(halves, streams):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            state.append([model.model.embed_tokens(mb.input_ids), None])
    prev_done: torch.cuda.Event | None = None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for i, (mb, s) in enumerate(zip(halves, streams)):
            with torch.cuda.stream(s):
                h, residual = state[i]
                x, residual = rms_norm(h, layer.input_layernorm.weight, eps, residual)
                t = x.shape[0]
                qkv = F.linear(x, attn.qkv_weight).view(t, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
                q, k, v = (qkv[:, :attn.num_heads], qkv[:, attn.num_heads: attn.num_heads + attn.num_kv_heads],
                           qkv[:, attn.num_heads + attn.num_kv_heads:])
                if alternate and prev_done is not None:
                    s.wait_event(prev_done)
                out = backend.forward_rope(attn.layer, q, k, v, mb.positions, inv_freq, kv, mb.meta)
                if alternate:
                    prev_done = torch.cuda.Event()
                    prev_done.record(s)
                h = F.linear(out.reshape(t, -1), attn.o_proj.weight)
                x, residual = rms_norm(h, layer.post_attention_layernorm.weight, eps, residual)
                h = F.linear(silu_mul(F.linear(x, mlp.gate_up_weight)), mlp.down_proj.weight)
                state[i] = [h, residual]
    outs = []
    for i, s in enumerate(streams):
        with torch.cuda.stream(s):
            hidden, _ = rms_norm(state[i][0], model.model.norm.weight, eps, state[i][1])
            outs.append(model.logits(hidden))
        main.wait_stream(s)
    return outs


def profile_graph(graph: torch.cuda.CUDAGraph, out: Path, name: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    trace = out / f"{name}_trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    trace.unlink()
    if not events:
        return {"error": "no kernel events in the trace"}
    events.sort(key=lambda e: e["ts"])
    # the last replay only: kernels after the largest gap-free run boundary (replays are back to back)
    per_replay = len(events) // 3
    last = events[-per_replay:]
    fam: dict[str, list[float]] = defaultdict(list)
    for e in last:
        n = e["name"]
        key = ("gemm" if any(s in n.lower() for s in ("gemm", "gemv", "nvjet", "cutlass", "sm90", "splitk"))
               else n.split("(")[0][:60])
        fam[key].append(e["dur"])
    span = last[-1]["ts"] + last[-1]["dur"] - last[0]["ts"]
    busy = sum(e["dur"] for e in last)
    gemm_names = sorted({e["name"][:120] for e in last if "gemm" in e["name"].lower() or "gemv" in e["name"].lower()
                         or "nvjet" in e["name"].lower()})
    return {"kernels_per_replay": per_replay, "span_us": round(span, 1), "busy_us": round(busy, 1),
            "gaps_us": round(span - busy, 1),
            "families": {k: {"count": len(v), "total_us": round(sum(v), 1), "mean_us": round(sum(v) / len(v), 2)}
                         for k, v in sorted(fam.items(), key=lambda kv: -sum(kv[1]))},
            "gemm_kernel_names": gemm_names[:12],
            "first_layer_sequence": [(e["name"][:50], round(e["dur"], 2)) for e in last[:16]]}


def engine_like_steps(graph: torch.cuda.CUDAGraph, batch: int, width: int, tokens: torch.Tensor,
                      steps: int = 200) -> dict:
    """ms per step of `graph` replayed as the engine's overlap mode does (graph replay alone; with a pinned
    host-to-device copy of the inputs before each replay and a device-to-host copy of the tokens after, the host
    reading step N's tokens after queueing step N + 1)."""
    words = 5 * batch + batch * width
    hosts = [torch.zeros(words, dtype=torch.int32).pin_memory() for _ in range(2)]
    dev = torch.zeros(words, dtype=torch.int32, device="cuda")  # read by nothing: the copy's cost only
    outs = [torch.zeros(batch, dtype=torch.int64).pin_memory() for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]
    res = {}
    for label in ("replay_only", "copies_around_replay"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            if label == "replay_only":
                graph.replay()
                continue
            turn = i % 2
            dev.copy_(hosts[turn], non_blocking=True)
            graph.replay()
            outs[turn].copy_(tokens, non_blocking=True)
            done[turn].record()
            done[turn ^ 1].synchronize()  # step i - 1's tokens, as the engine reads them
            outs[turn ^ 1].tolist()
        torch.cuda.synchronize()
        res[label] = round((time.perf_counter() - t0) / steps * 1e3, 4)
    return res


def replay_gaps(graph: torch.cuda.CUDAGraph, out: Path, replays: int = 6) -> dict:
    """Back-to-back replays under the profiler: the idle time from one replay's last kernel to the next one's
    first, and the largest idle time inside a replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    trace = out / "replay_gaps_trace.json"
    prof.export_chrome_trace(str(trace))
    events = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                    key=lambda e: e["ts"])
    trace.unlink()
    per = len(events) // replays
    if not per:
        return {"error": "no kernel events in the trace"}
    between = [events[r * per]["ts"] - (events[r * per - 1]["ts"] + events[r * per - 1]["dur"])
               for r in range(1, replays)]
    inside = [events[i + 1]["ts"] - (events[i]["ts"] + events[i]["dur"]) for i in range(per - 1)]
    return {"kernels_per_replay": per, "between_replays_us": [round(g, 1) for g in between],
            "inside_sum_us": round(sum(inside), 1), "inside_max_us": round(max(inside), 1)}


def alternate_graphs(engine, variants: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """The engine's decode steps with each of `variants` (label → DecodeGraphs) in turn, `rounds` times: ms per step
    of each round, by label (the pipeline flushed and one step untimed at each switch)."""
    step_ms: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for label, graphs in variants.items():
            engine.flush()
            engine.graphs = graphs
            engine.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            step_ms[label].append((time.perf_counter() - t0) / steps * 1e3)
    engine.flush()
    return step_ms


def llama_engine(max_num_seqs: int, **engine_kwargs):
    """An engine (gpu_suite.make_engine, 8,192-token chunks) on random:llama3-8b in bf16, the loader's copy of the
    weights freed."""
    from services.gpu_worker.model.loader import load_model

    loaded = load_model("random:llama3-8b", dtype=torch.bfloat16, device="cuda", seed=0)
    engine = make_engine(loaded, max_num_seqs=max_num_seqs, chunk=8192, **engine_kwargs)
    loaded.state_dict.clear()
    torch.cuda.empty_cache()
    return engine


def engine_batch1(out: Path) -> dict:
    """The engine's own batch-1 decode steps (overlap mode, one graph bucket) under the profiler: what the GPU
    runs besides the graph replay, and where it waits for the host."""
    from torch.profiler import ProfilerActivity, profile

    from services.gpu_worker.request import SamplingParams

    engine = llama_engine(1)
    engine.add_request("p", list(range(100, 612)), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    for _ in range(60):
        engine.step()
    host = []
    for _ in range(40):
        t0 = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - t0)
    # A/B in turn, 3 rounds of 50 steps: the bucket's graph captured with programmatic dependent launch (the
    # engine's own, EngineConfig.pdl "off" by default) and the other way
    from services.gpu_worker.cuda_graphs import DecodeGraphs

    own = "pdl_on" if pdl.is_enabled() else "pdl_off"
    variants = {own: engine.graphs}
    pdl.set_enabled(own == "pdl_off")
    other = DecodeGraphs(engine.model, engine.kv, engine.backend, 1, engine.max_seq_len)
    other.capture()
    variants["pdl_off" if own == "pdl_on" else "pdl_on"] = other
    pdl.set_enabled(own == "pdl_on")
    step_ab = alternate_graphs(engine, variants, rounds=3, steps=50)
    engine.graphs = variants[own]
    steps = 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    trace = out / "engine_b1_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    gaps: dict[str, list[float]] = defaultdict(list)
    for cur, nxt in zip(gpu, gpu[1:]):
        gap = nxt["ts"] - (cur["ts"] + cur["dur"])
        if gap > 3.0:
            gaps[f"{cur['name'][:40]} -> {nxt['name'][:40]}"].append(gap)
    fam: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        n = e["name"]
        if not any(t in n.lower() for t in ("gemm", "gemv", "nvjet", "splitk", "_rms_norm", "_decode_", "_silu")):
            fam[n[:70]].append(e["dur"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    busy = sum(e["dur"] for e in gpu)
    cpu_ops: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cpu_op":
            cpu_ops[e["name"][:50]].append(e["dur"])
    top_cpu = sorted(((k, sum(v) / steps, len(v) / steps) for k, v in cpu_ops.items()), key=lambda r: -r[1])[:15]
    def per_step(groups: dict[str, list[float]], top: int) -> dict:
        return {k: {"per_step": round(len(v) / steps, 2), "us_per_step": round(sum(v) / steps, 2)}
                for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]}

    return {"host_step_ms_median": round(sorted(host)[len(host) // 2] * 1e3, 4),
            "step_ms_by_pdl": {k: [round(v, 4) for v in vs] for k, vs in step_ab.items()},
            "gpu_span_per_step_us": round(span / steps, 1), "gpu_busy_per_step_us": round(busy / steps, 1),
            "gaps_over_3us_per_step": per_step(gaps, 10),
            "non_layer_gpu_work_per_step": per_step(fam, 12),
            "host_calls_per_step_us": [(k, round(t, 1), round(n, 1)) for k, t, n in top_cpu]}


def batch1_engine(kv_cache_dtype: str = "auto", gemv_max_tokens: int | None = None):
    """An engine of one sequence (random:llama3-8b, overlap mode) 20 steps into decoding a 512-token prompt, with
    4000 tokens to go; its matmuls as EngineConfig.gemv_max_tokens says (None: the default)."""
    from services.gpu_worker.request import SamplingParams

    engine = llama_engine(1, kv_cache_dtype=kv_cache_dtype, gemv_max_tokens=gemv_max_tokens)
    engine.add_request("p", list(range(100, 612)),
                       SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
    for _ in range(20):
        engine.step()
    return engine


def step_summary(step_ms: dict[str, list[float]], roofline_ms: float | None = 3.76) -> dict:
    """alternate_graphs' rounds by variant → each round, each variant's median, its ratio to the first variant's
    (the baseline) and to roofline_ms (the batch-1 roofline by default; None: no such ratio)."""
    med = {k: sorted(v)[len(v) // 2] for k, v in step_ms.items()}
    first = next(iter(med))
    summary = {"step_ms": {k: [round(x, 4) for x in v] for k, v in step_ms.items()},
               "median_ms": {k: round(v, 4) for k, v in med.items()},
               f"over_{first}": {k: round(v / med[first], 4) for k, v in med.items()}}
    if roofline_ms:
        summary["tpot_over_roofline"] = {k: round(v / roofline_ms, 4) for k, v in med.items()}
    return summary


def engine_batch1_prefetch(pcfg: l2_prefetch.PrefetchConfig, rounds: int = 5, steps: int = 60) -> dict:
    """The engine's batch-1 decode steps (overlap mode, 512-token prompt) with its graph captured without and with
    the L2 prefetch `pcfg`, in turn: `rounds` rounds of `steps` steps each."""
    from services.gpu_worker.cuda_graphs import DecodeGraphs

    engine = batch1_engine()
    variants = {"off": engine.graphs}
    engine.model.l2_prefetcher = l2_prefetch.L2Prefetcher(pcfg, engine.device)
    variants["on"] = DecodeGraphs(engine.model, engine.kv, engine.backend, 1, engine.max_seq_len)
    variants["on"].capture()
    engine.model.l2_prefetcher = None
    return {"config": str(pcfg), **step_summary(alternate_graphs(engine, variants, rounds, steps))}


def engine_batch1_tiles(tiles: dict, kv_cache_dtype: str = "auto", rounds: int = 5, steps: int = 60) -> dict:
    """The engine's batch-1 decode steps (overlap mode, 512-token prompt) with its graph captured under each split
    kernel tile of `tiles` (label → tile, None: the default), in turn: `rounds` rounds of `steps` steps each."""
    from services.gpu_worker.cuda_graphs import DecodeGraphs
    from services.gpu_worker.kernels import decode_attention as da

    engine = batch1_engine(kv_cache_dtype)
    default_tile = da.default_tile
    variants = {}
    try:
        for label, tile in tiles.items():
            da.default_tile = default_tile if tile is None else (lambda *_, t=tile: t)
            variants[label] = DecodeGraphs(engine.model, engine.kv, engine.backend, 1, engine.max_seq_len)
            variants[label].capture()
    finally:
        da.default_tile = default_tile
    return {"kv_cache_dtype": str(engine.kv.dtype), "tiles": {k: list(t) if t else None for k, t in tiles.items()},
            **step_summary(alternate_graphs(engine, variants, rounds, steps))}


def engine_batch1_gemv(best: dict, kv_cache_dtype: str = "auto", rounds: int = 5, steps: int = 60) -> dict:
    """The engine's batch-1 decode steps (overlap mode, 512-token prompt) with its graph captured with the matmuls on
    cuBLAS, on the Triton GEMV with kernels/gemv.py's tiles (its TUNED table, else its heuristic) and on it with the
    fastest tiles of `best` (kernel_table.gemv_sweep's, through gemv_tuning), in turn: `rounds` rounds of `steps`
    steps each."""
    from bench.kernel_table import gemv_tuning
    from services.gpu_worker.cuda_graphs import DecodeGraphs
    from services.gpu_worker.kernels import gemv as g

    engine = batch1_engine(kv_cache_dtype, gemv_max_tokens=0)
    tuned, row_parts = gemv_tuning(best)
    settings = {"gemv_default": (dict(g.TUNED), g.ROW_PARTS), "gemv_swept": (tuned, row_parts)}
    variants = {"cublas": engine.graphs}
    engine.model.gemv_max_tokens = 1
    try:
        for label, (table, parts) in settings.items():
            with g.tiles_as(table, parts):
                variants[label] = DecodeGraphs(engine.model, engine.kv, engine.backend, 1, engine.max_seq_len)
                variants[label].capture()
    finally:
        engine.model.gemv_max_tokens = 0
    return {"kv_cache_dtype": str(engine.kv.dtype), "row_parts_swept": row_parts,
            "swept": {"x".join(map(str, key)): list(cfg) for key, cfg in tuned.items()},
            **step_summary(alternate_graphs(engine, variants, rounds, steps))}


def blas_sweep(copy_tbs: float, tokens: tuple = (64, 128, 256, 384, 512)) -> dict:
    """Each Llama-3.1-8B projection through F.linear (whole rows) at each token count of W0's and W1's decode steps,
    with torch's cuBLAS and with cuBLASLt (torch.backends.cuda.preferred_blas_library), each row timed inside a graph
    (kernel_table.Table.gemv) → {lib: rows (with TFLOP/s), "lt_over_cublas": ratio of µs by row}."""
    from bench.kernel_table import LLAMA3_8B, MAX_CALLS, Table, gemv_shapes, graph_timer

    out: dict = {}
    try:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            t = Table(LLAMA3_8B, graph_timer, MAX_CALLS, copy_tbs, "cuda", torch.bfloat16)
            for name, n, k, _ in gemv_shapes(LLAMA3_8B):
                for m in tokens:
                    row = t.gemv(name, m, n, k, 1)
                    row["tflops"] = round(2 * m * n * k / (row["us"] * 1e-6) / 1e12, 1)
            out[lib] = t.rows
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    out["lt_over_cublas"] = {row: round(out["cublaslt"][row]["us"] / out["cublas"][row]["us"], 3)
                             for row in out["cublas"]}
    return out


def engine_steps_blas(num_seqs: int = 128, rounds: int = 5, steps: int = 30) -> dict:
    """W0's decode steps (num_seqs sequences past 512-token prompts, overlap mode) with the graphs captured under
    torch's cuBLAS (the engine's own) and under cuBLASLt, replayed in turn: `rounds` rounds of `steps` steps each."""
    from services.gpu_worker.cuda_graphs import DecodeGraphs
    from services.gpu_worker.request import SamplingParams

    engine = llama_engine(num_seqs)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts_for(num_seqs, 512, engine.model_config.vocab_size, 0)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(20):  # 8 prefill steps of 8,192 tokens, then decodes
        engine.step()
    variants = {"cublas": engine.graphs}
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        variants["cublaslt"] = DecodeGraphs(engine.model, engine.kv, engine.backend, num_seqs, engine.max_seq_len)
        variants["cublaslt"].capture()
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    return {"num_seqs": num_seqs, **step_summary(alternate_graphs(engine, variants, rounds, steps), roofline_ms=None)}


def w1_mixed_steps(num_requests: int) -> dict:
    """W1's shape (1000 → 1000, 384 sequences) on one engine, four runs in turn: mixed steps sending their
    decodes to the extend kernel with the prefill chunks (the default), then to the decode kernel
    (TritonAttention.mixed_decodes_to_decode_kernel), twice each. Decode-only steps replay the same graphs in
    all. Same prompts, same run."""
    engine = llama_engine(384)
    engine.is_overlapped = True
    prompts = prompts_for(num_requests, 1000, engine.model_config.vocab_size, 2)
    res: dict = {"num_requests": num_requests}
    # warm-up: mixed steps of 8 to 48 decodes compile every split count's eager variant of each path (the
    # first A/B, with a 20-request warm-up, left compiles inside the timed run)
    for to_decode in (True, False):
        engine.backend.mixed_decodes_to_decode_kernel = to_decode
        run_timed(engine, prompts[:64], 16)
    for to_decode in (False, True, False, True):  # in turn, so neither owns the first or the last run
        engine.backend.mixed_decodes_to_decode_kernel = to_decode
        r = run_timed(engine, prompts, 1000)
        decode_s = sum(dt for *_, dt in r["decode_steps"])
        res.setdefault("decodes_to_decode_kernel" if to_decode else "decodes_to_extend_kernel", []).append({
            "seconds": round(r["seconds"], 3), "output_tok_s": round(r["output_tok_s"], 1),
            "decode_only_steps": len(r["decode_steps"]), "decode_only_seconds": round(decode_s, 3),
            "steps_with_prefill_seconds": round(r["seconds"] - decode_s, 3)})
    engine.backend.mixed_decodes_to_decode_kernel = False
    best = {k: max(run["output_tok_s"] for run in res[k])
            for k in ("decodes_to_decode_kernel", "decodes_to_extend_kernel")}
    res["throughput_ratio_of_best_runs"] = round(best["decodes_to_decode_kernel"] / best["decodes_to_extend_kernel"], 4)
    return res


def fp8_tile_sweep(copy_tbs: float, shapes: tuple = ((64, 1504), (384, 1504)), fp8: list | None = None,
                   layouts: tuple = (False, True), with_bf16: bool = True) -> dict:
    """Decode attention with RoPE, 32 layers in one graph, over an FP8 cache by the split kernel's tile (keys per
    tile, warps, pipeline stages, fp16 dots, register cap, assembly unpacking) and V layout (rows, or key pairs as
    the engine stores it), beside the bf16 cache at two tiles; no model. The pairs runs read the same V as the rows
    runs (kv_cache.v_pairs_of), so every output matches the first. Each shape's row names the fastest variant of
    each cache dtype (best_<dtype>: [tile..., "rows" or "pairs"]). fp8 and layouts (V in key pairs or not) replace
    the FP8 grid; with_bf16=False leaves the bf16 cache out."""
    from services.gpu_worker.kv_cache import v_pairs_of
    from services.gpu_worker.model.rope import inv_frequencies

    cfg = preset("llama3-8b")
    inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).float().cuda()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_pages = 1 + max(b * -(-ctx // PAGE) for b, ctx in shapes) + 64
    width = 4096 // PAGE
    # (tile, V in key pairs): decode_attention.py's notes on TILE say why. Earlier sweeps
    # (h200_probe_20261203_{e,f}_*.json) also ran a V-widening option, since dropped, and 8 warps and 5 stages.
    fp8 = [(tile, pairs) for tile in fp8 for pairs in layouts if pairs or not tile[5]] if fp8 else [
        ((128, 4, 2, True, 0, False), False), ((128, 4, 2, True, 0, False), True), ((128, 4, 2, True, 0, True), True),
        ((128, 4, 2, True, 128, False), False), ((128, 4, 2, True, 128, True), True),
        ((64, 4, 2, True, 0, False), True), ((64, 4, 2, True, 0, True), True), ((128, 4, 3, True, 0, True), True)]
    plans = {"bfloat16": [((64, 4, 2, False, 0, False), False), ((128, 4, 2, False, 0, False), False)], "fp8": fp8}
    if not with_bf16:
        del plans["bfloat16"]
    res: dict = {}
    for label, variants in plans.items():
        dtype = torch.bfloat16 if label == "bfloat16" else torch.float8_e4m3fn
        kv = KVCache(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda")
        for pool in (kv.k, kv.v):
            for layer in pool:
                layer.copy_(torch.randn(layer.shape, device="cuda", dtype=torch.bfloat16))
        # the engine's FP8 V holds key pairs; this pool's V is rows, and v_pairs the same values in pairs
        v_pairs = [v_pairs_of(layer) for layer in kv.v] if label == "fp8" else None
        with torch.inference_mode():
            for batch, ctx in shapes:
                mb = Batch(batch, ctx, 1, width, "cuda")
                qkv = torch.randn((batch, 48, 128), device="cuda", dtype=torch.bfloat16)
                q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
                splits = num_splits_for(batch, cfg.num_kv_heads, num_sms)
                row = res.setdefault(f"B{batch}_L{ctx}", {
                    "kv_read_ms_at_copy_bf16": round(batch * ctx * 131072 / (copy_tbs * 1e12) * 1e3, 3),
                    "kv_read_ms_at_copy_fp8": round(batch * ctx * 65536 / (copy_tbs * 1e12) * 1e3, 3)})
                first = None
                for tile, pairs in variants:
                    v_pool = v_pairs if pairs else kv.v

                    def attend(tile=tile, pairs=pairs, v_pool=v_pool):
                        return [decode_attention_rope(q, k, v, mb.positions, inv_freq, kv.k[i], v_pool[i], mb.slots,
                                                      mb.page_table, mb.seq_lens, splits, tile=tile, v_pairs=pairs)
                                for i in range(cfg.num_layers)]
                    key = f"{label}_{tile_name(tile)}" + ("_pairs" if pairs else "")
                    try:
                        out0 = attend()[0].float()
                        first = out0 if first is None else first
                        g = graph_of(attend)
                        row[key + "_ms"] = round(bench_ms(g.replay), 4)
                        if row[key + "_ms"] < row.get(f"best_{label}_ms", float("inf")):
                            row[f"best_{label}"] = [*tile, "pairs" if pairs else "rows"]
                            row[f"best_{label}_ms"] = row[key + "_ms"]
                        row[key + "_rel_diff"] = float((out0 - first).norm() / first.norm())
                        del g
                    except Exception as exc:  # a tile that cannot compile (shared memory) is recorded, not fatal
                        row[key + "_error"] = repr(exc)[:200]
        del kv, v_pairs
        torch.cuda.empty_cache()
    return res


def gemv_table(copy_tbs: float) -> dict:
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    forms = {"mv": lambda x, w: torch.mv(w, x[0]), "matmul_w_xT": lambda x, w: torch.matmul(w, x.t()),
             "linear_m2": lambda x, w: F.linear(x.expand(2, -1), w)}
    res = {}

    def timed(label: str, name: str, call) -> None:
        """One M = 1 call per distinct weight copy, all in one graph, so nothing stays in L2."""
        n, k = shapes[name]
        copies = max(2, min(16, int(2e9 // (n * k * 2))))
        ws = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        g = graph_of(lambda: [call(x, w) for w in ws])
        ms = bench_ms(g.replay) / copies
        tbs = n * k * 2 / (ms * 1e-3) / 1e12
        res[f"{label}_{name}"] = {"us": round(ms * 1e3, 2), "tb_s": round(tbs, 3), "of_copy": round(tbs / copy_tbs, 3)}

    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name in shapes:
            timed(lib, name, F.linear)
    torch.backends.cuda.preferred_blas_library("cublas")
    for name in ("qkv", "o", "down"):
        for form, call in forms.items():
            timed(form, name, call)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        timed("linear_no_reduced_precision", name, F.linear)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    return res


def gemv_split_table(copy_tbs: float) -> dict:
    """M = 1 projections through other cuBLAS call forms (all through torch): the weight stored transposed
    ([K, N], x @ Wt), and split-K as a strided batched GEMM of S slices (bmm) with bf16 partials summed by
    torch or fp32 partials (out_dtype) left for the next kernel to sum. Time per projection, no L2 reuse."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    res: dict = {}

    def timed(label: str, n: int, k: int, make, call) -> None:
        copies = max(2, min(16, int(2e9 // (n * k * 2))))
        ws = [make(torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        try:
            g = graph_of(lambda: [call(x, w) for w in ws])
        except Exception as exc:  # a call form cuBLAS or torch refuses: recorded, the rest go on
            res[label] = {"error": repr(exc)[:200]}
            return
        ms = bench_ms(g.replay) / copies
        tbs = n * k * 2 / (ms * 1e-3) / 1e12
        res[label] = {"us": round(ms * 1e3, 2), "of_copy": round(tbs / copy_tbs, 3)}
        del g, ws

    def sliced(w: torch.Tensor, s: int) -> torch.Tensor:  # [N, K] → [S, K/S, N] view, no copy
        n, k = w.shape
        return w.view(n, s, k // s).permute(1, 2, 0)

    for name, (n, k) in shapes.items():
        timed(f"linear_{name}", n, k, lambda w: w, F.linear)
        timed(f"mm_transposed_{name}", n, k, lambda w: w.t().contiguous(), lambda x, wt: torch.mm(x, wt))
        timed(f"mm_f32out_{name}", n, k, lambda w: w, lambda x, w: torch.mm(x, w.t(), out_dtype=torch.float32))
        for s in (2, 4, 7, 8):
            if k % s or (s == 7 and name != "down"):
                continue
            xs = lambda x, s=s: x.view(1, s, -1).transpose(0, 1)  # [S, 1, K/S]
            timed(f"bmm_s{s}_bf16_sum_{name}", n, k, lambda w: w,
                  lambda x, w, s=s: torch.bmm(xs(x), sliced(w, s)).sum(0))
            timed(f"bmm_s{s}_f32_{name}", n, k, lambda w: w,
                  lambda x, w, s=s: torch.bmm(xs(x), sliced(w, s), out_dtype=torch.float32))
            timed(f"bmm_s{s}_f32_sum_{name}", n, k, lambda w: w,
                  lambda x, w, s=s: torch.bmm(xs(x), sliced(w, s), out_dtype=torch.float32).sum(0))
            timed(f"bmm_s{s}_f32_presplit_{name}", n, k, lambda w, s=s: sliced(w, s).contiguous(),
                  lambda x, w, s=s: torch.bmm(xs(x), w, out_dtype=torch.float32))
    return res


class StreamedGemms:
    """One projection's GEMM cut into parts that run at once on side streams (forked from and joined to the
    current stream, so a captured graph holds them as parallel branches): linear() cuts the output rows (N),
    row_projection() cuts fused._row_projection's split-K slices, each part writing its own share of one output."""

    def __init__(self, parts: int, max_tokens: int = 32, side: bool = True) -> None:
        """side=False: the same parts in order on the current stream."""
        self.parts, self.max_tokens, self.side = parts, max_tokens, side
        self.side_streams = [torch.cuda.Stream() for _ in range(parts)]

    @property
    def streams(self) -> list:
        return self.side_streams if self.side else [torch.cuda.current_stream()] * self.parts

    def _fork(self):
        main = torch.cuda.current_stream()
        for s in self.streams:
            if s != main:
                s.wait_stream(main)
        return main

    def _join(self, main) -> None:
        for s in self.streams:
            if s != main:
                main.wait_stream(s)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
        n = w.shape[0]
        if bias is not None or x.shape[0] > self.max_tokens or n % self.parts:
            return F.linear(x, w, bias)
        out = x.new_empty((x.shape[0], n))
        step, main = n // self.parts, self._fork()
        for i, s in enumerate(self.streams):
            with torch.cuda.stream(s):
                torch.mm(x, w[i * step:(i + 1) * step].t(), out=out[:, i * step:(i + 1) * step])
        self._join(main)
        return out

    def row_projection(self, x: torch.Tensor, w: torch.Tensor, num_parts: int) -> torch.Tensor:
        if num_parts == 1 or num_parts % self.parts or x.shape[1] % num_parts:
            return ROW_PROJECTION(x, w, num_parts)
        (t, k), n = x.shape, w.shape[0]
        xs = x.view(t, num_parts, k // num_parts).transpose(0, 1)
        ws = w.view(n, num_parts, k // num_parts).permute(1, 2, 0)
        out = torch.empty((num_parts, t, n), device=x.device, dtype=torch.float32)
        step, main = num_parts // self.parts, self._fork()
        for i, s in enumerate(self.streams):
            with torch.cuda.stream(s):
                sl = slice(i * step, (i + 1) * step)
                torch.bmm(xs[sl], ws[sl], torch.float32, out=out[sl])
        self._join(main)
        return out


class LinearShim:
    """fused.F for the streamed variants: F.linear through StreamedGemms, the rest of torch.nn.functional as is."""

    def __init__(self, gemms: StreamedGemms) -> None:
        self.linear = gemms.linear

    def __getattr__(self, name: str):
        return getattr(F, name)


ROW_PROJECTION = fused._row_projection


def gemv_streams_table(copy_tbs: float) -> dict:
    """M = 1 projections, one GEMM against the same cut into 2 or 4 parts on side streams (StreamedGemms) or on the
    one stream: time per projection over distinct weight copies (no L2 reuse), each copy after the previous."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    res: dict = {}
    for name, (n, k) in shapes.items():
        copies = max(2, min(16, int(2e9 // (n * k * 2))))
        ws = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        rows = name in ("o", "down")  # the engine's split-K form (4 slices, fp32 partials)
        calls = {"one": (lambda w: ROW_PROJECTION(x, w, 4)) if rows else (lambda w: F.linear(x, w))}
        for parts in (2, 4):
            g = StreamedGemms(parts)
            calls[f"streams{parts}"] = (lambda w, g=g: g.row_projection(x, w, 4)) if rows else (
                lambda w, g=g: g.linear(x, w))
            one = StreamedGemms(parts, side=False)  # the same cut, in order on one stream
            calls[f"cut{parts}_one_stream"] = (lambda w, g=one: g.row_projection(x, w, 4)) if rows else (
                lambda w, g=one: g.linear(x, w))
        ref = calls["one"](ws[0]).float()
        row: dict = {}
        graphs = {}
        for label, call in calls.items():
            out = call(ws[0]).float()
            torch.cuda.synchronize()
            if not torch.equal(out, ref):
                row[f"{label}_max_abs_diff"] = float((out - ref).abs().max())
            graphs[label] = graph_of(lambda call=call: [call(w) for w in ws])
        times: dict[str, list[float]] = {label: [] for label in graphs}
        for _ in range(3):
            for label, g in graphs.items():
                times[label].append(bench_ms(g.replay) * 1e3 / copies)
        for label, ts in times.items():
            us = sorted(ts)[1]
            row[f"{label}_us"] = round(us, 2)
            row[f"{label}_of_copy"] = round(n * k * 2 / (us * 1e-6) / 1e12 / copy_tbs, 3)
        res[name] = row
        del graphs, ws
    return res


def argmax_table() -> dict:
    """Greedy argmax over a 128,256-token vocabulary: torch.argmax vs kernels/argmax.py, fp32 logits."""
    from services.gpu_worker.kernels.argmax import argmax_rows

    res = {}
    for batch in (1, 8, 128, 384):
        x = torch.randn((batch, 128256), device="cuda")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        for label, call in (("torch", lambda: x.argmax(dim=-1)), ("triton", lambda: argmax_rows(x))):
            g = graph_of(call)
            res[f"{label}_B{batch}_us"] = round(bench_ms(g.replay) * 1e3, 2)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--phases", default="gemv,batch1,splits,micro,engine,mixed",
                   help="comma-separated; also gemv_split, argmax, splitk, norm, pdl, fp8kv, fp8tune, l2pf, "
                        "l2pf_engine, multistep, streams, tiles_engine, gemv_engine")
    p.add_argument("--mixed-requests", type=int, default=1000, help="W1 requests for the mixed-steps phase")
    p.add_argument("--fp8tune-shapes", default="64x1504,384x1504", help="fp8tune: batch x context, comma-separated")
    p.add_argument("--fp8tune-tiles", default="",
                   help="fp8tune: FP8 tiles keys,warps,stages,fp16_dots,max_regs[,asm_unpack] separated by ';', each "
                        "run over V in rows and in key pairs (an asm tile: pairs only); default: the grid")
    p.add_argument("--gemv-wide", action="store_true",
                   help="gemv_engine: one token only, over kernel_table.gemv_tiles_wide, split counts 1 and 2")
    p.add_argument("--gemv-tiles", default="", help="gemv_engine: one token only, whole rows, these tiles "
                   "(block_n,block_k,num_warps,num_stages separated by ';')")
    p.add_argument("--gemv-kv-cache", default="auto",
                   help="gemv_engine: the engine A/B's KV cache dtypes, e.g. auto,fp8")
    args = p.parse_args()
    phases = set(args.phases.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"command": "python -m bench.h200_probe", "hardware": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "phases": {}}
    t_start = time.perf_counter()

    def save(name: str, fig) -> None:
        record["phases"][name] = fig
        (out / "h200_probe.json").write_text(json.dumps(record, indent=2))
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}: {json.dumps(fig)[:2500]}", flush=True)

    copy_tbs = copy_bandwidth()
    save("copy", {"tb_s": round(copy_tbs, 3)})

    if "gemv" in phases:
        save("gemv_m1", gemv_table(copy_tbs))
    if "gemv_split" in phases:
        save("gemv_m1_split_forms", gemv_split_table(copy_tbs))
    if "argmax" in phases:
        save("argmax", argmax_table())

    if "fp8tune" in phases:
        shapes = tuple(tuple(int(x) for x in shape.split("x")) for shape in args.fp8tune_shapes.split(","))
        tiles = [parse_tile(t) for t in args.fp8tune_tiles.split(";") if t]
        save("fp8_tile_sweep", fp8_tile_sweep(copy_tbs, shapes, tiles or None))
        torch.cuda.empty_cache()
    if "engine" in phases:
        save("engine_batch1_profile", engine_batch1(out))
        torch.cuda.empty_cache()
    if "mixed" in phases:
        save("w1_mixed_steps", w1_mixed_steps(args.mixed_requests))
        torch.cuda.empty_cache()
    if "gemv_engine" in phases:  # the Triton GEMV (kernels/gemv.py): each projection by tile, then the engine's step
        from bench.kernel_table import gemv_sweep, gemv_tiles, gemv_tiles_wide

        listed = tuple(tuple(int(x) for x in tile.split(",")) for tile in args.gemv_tiles.split(";") if tile)
        if listed:  # the one-row kernel only, with these tiles, whole rows
            sweep = gemv_sweep(copy_tbs=copy_tbs, tokens=(1,), tiles=lambda m: listed, max_parts=1)
        elif args.gemv_wide:  # the one-row kernel only, over the wider grid, at 1 and 2 parts
            sweep = gemv_sweep(copy_tbs=copy_tbs, tokens=(1,), tiles=gemv_tiles_wide, max_parts=2)
        else:
            sweep = gemv_sweep(copy_tbs=copy_tbs, tiles=gemv_tiles)
        save("gemv_sweep", sweep)
        torch.cuda.empty_cache()
        for cache in args.gemv_kv_cache.split(","):
            save(f"engine_batch1_gemv_{cache}", engine_batch1_gemv(sweep["best"], cache))
            gc.collect()
            torch.cuda.empty_cache()
    if "blas" in phases:  # cuBLAS against cuBLASLt at W0's and W1's token counts, then in W0's decode steps
        for name, run in (("blas_sweep", lambda: blas_sweep(copy_tbs)), ("engine_steps_blas", engine_steps_blas)):
            try:
                save(name, run())
            except Exception as exc:  # e.g. a capture cuBLASLt refuses: keep the other's figures
                save(name, {"error": repr(exc)})
            gc.collect()
            torch.cuda.empty_cache()
    if "tiles_engine" in phases:  # the split kernel's tile at batch 1 (bench/kernel_table.py --tile-sweep)
        for cache, tiles in (("auto", {"default": None, "bf16_32x4": (32, 4, 2, False, 0, False),
                                       "bf16_16x4": (16, 4, 2, False, 0, False)}),
                             ("fp8", {"default": None, "fp8_32x4": (32, 4, 2, True, 0, True),
                                      "fp8_64x4": (64, 4, 2, True, 0, True)})):
            save(f"engine_batch1_tiles_{cache}", engine_batch1_tiles(tiles, cache))
            gc.collect()
            torch.cuda.empty_cache()
    if not phases & {"batch1", "splits", "micro", "splitk", "norm", "pdl", "fp8kv", "l2pf", "multistep", "streams"}:
        if "l2pf_engine" in phases:
            save("engine_batch1_l2_prefetch", engine_batch1_prefetch(l2_prefetch.DEFAULT_CONFIG))
        return 0
    cfg = preset("llama3-8b")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    for prm in model.parameters():
        prm.data.normal_(0, 0.02)
    for layer in model.model.layers:
        layer.input_layernorm.weight.data.fill_(1.0)
        layer.post_attention_layernorm.weight.data.fill_(1.0)
    model.model.norm.weight.data.fill_(1.0)
    model.inv_freq = model.inv_freq.float()
    model.eval()
    model.enable_fused_kernels()
    backend = TritonAttention()
    max_ctx = 1504
    num_pages = 1 + 384 * (max_ctx // PAGE) + 64
    kv = KVCache(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
    kv.k.normal_(0, 1)
    kv.v.normal_(0, 1)
    width = 4096 // PAGE

    def full(mb: Batch):
        return lambda: model.logits(fused.forward(model, mb.input_ids, mb.positions, kv, mb.meta, backend))

    # 1. batch 1 at 640 tokens of context: graph replay and its kernels
    b1 = Batch(1, 640, 1, width, "cuda")
    model.split_k_max_tokens = fused.SPLIT_K_MAX_TOKENS
    fig1: dict = {}
    with torch.inference_mode():
        for fuse in ((True, False) if "batch1" in phases else ()):
            backend.fuse_decode = fuse
            label = "fused_decode" if fuse else "separate_rope_kv_write"
            g1 = graph_of(full(b1))
            fig1[label] = {"replay_ms": round(bench_ms(g1.replay), 4)}
            try:
                fig1[label]["profile"] = profile_graph(g1, out, "b1")
            except Exception as exc:  # the profiler is a diagnosis aid; its absence must not cost the rest
                fig1[label]["profile"] = {"error": repr(exc)[:300]}
            del g1
        if "batch1" in phases:
            fig1["replay_ratio_fused_over_separate"] = round(
                fig1["fused_decode"]["replay_ms"] / fig1["separate_rope_kv_write"]["replay_ms"], 4)
            for batch, ctx in ((128, 640), (384, 1504)):  # W0's and W1's decode steps
                mb = Batch(batch, ctx, 1, width, "cuda")
                row = {}
                for fuse in (True, False):
                    backend.fuse_decode = fuse
                    g = graph_of(full(mb))
                    row["fused_ms" if fuse else "separate_ms"] = round(bench_ms(g.replay), 4)
                    del g
                row["ratio"] = round(row["fused_ms"] / row["separate_ms"], 4)
                fig1[f"B{batch}_L{ctx}"] = row
            save("batch1_graph", fig1)
        backend.fuse_decode = True

    # 1b. o_proj/down_proj split-K (fused.SPLIT_K_*) vs F.linear, graph replay by batch; relaunching one
    #     graph vs two captures of it in turn
    if "splitk" in phases:
        figk: dict = {}
        with torch.inference_mode():
            for batch in (1, 2, 4, 8, 16, 32, 64):
                mb = Batch(batch, 640, 1, width, "cuda")
                row = {}
                for label, limit in (("split_k_ms", 1 << 20), ("linear_ms", 0)):
                    model.split_k_max_tokens = limit
                    g = graph_of(full(mb))
                    row[label] = round(bench_ms(g.replay), 4)
                    if batch == 1 and limit:
                        figk["B1_split_k_profile"] = profile_graph(g, out, "b1k")
                    del g
                row["ratio"] = round(row["split_k_ms"] / row["linear_ms"], 4)
                figk[f"B{batch}_L640"] = row
            model.split_k_max_tokens = fused.SPLIT_K_MAX_TOKENS
            ga, gb = graph_of(full(b1)), graph_of(full(b1))
            for label, seq in (("same_graph", [ga, ga]), ("two_graphs_in_turn", [ga, gb])):
                torch.cuda.synchronize()
                host_us, t0 = [], time.perf_counter()
                for i in range(200):
                    h0 = time.perf_counter()
                    seq[i % 2].replay()
                    host_us.append((time.perf_counter() - h0) * 1e6)
                torch.cuda.synchronize()
                figk[f"relaunch_{label}"] = {"ms_per_replay": round((time.perf_counter() - t0) / 200 * 1e3, 4),
                                             "replay_call_host_us_median": round(sorted(host_us)[100], 1)}
            del ga, gb
        save("split_k", figk)

    # 1c. RMSNorm at one token: warps per program, with and without split-K partials (64 calls in one graph),
    #     and the whole batch-1 forward with each warp count
    if "norm" in phases:
        fign: dict = {}
        with torch.inference_mode():
            w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
            res = torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16)
            for parts in (1, 4):
                x = (torch.randn((1, 4096), device="cuda", dtype=torch.bfloat16) if parts == 1
                     else torch.randn((parts, 1, 4096), device="cuda", dtype=torch.float32))
                for warps in (2, 4, 8, 16):
                    g = graph_of(lambda: [rms_norm(x, w, 1e-5, res, num_warps=warps) for _ in range(64)])
                    fign[f"parts{parts}_warps{warps}_us"] = round(bench_ms(g.replay) * 1e3 / 64, 3)
                    del g
            plain = fused.rms_norm
            for warps in (4, 8, 16):
                fused.rms_norm = lambda *a, warps=warps: plain(*a, num_warps=warps)
                g = graph_of(full(b1))
                fign[f"B1_forward_warps{warps}_ms"] = round(bench_ms(g.replay), 4)
                del g
            fused.rms_norm = plain
        save("rms_norm_b1", fign)

    # 1d. programmatic dependent launch: the whole forward + LM head captured at PDL levels 0 (off), 1 (wait
    #     only) and 2 (wait, and trigger the next launch at the start), replayed in turn (3 rounds); logits
    #     compared with level 0's; the batch-1 graph's profile at level 1
    if "pdl" in phases:
        figp: dict = {}
        levels = (0, 1, 2)
        with torch.inference_mode():
            for batch, ctx in ((1, 640), (1, 4096), (8, 640), (64, 640), (128, 640)):
                mb = Batch(batch, ctx, 1, width, "cuda")
                graphs, logits = {}, {}
                for level in levels:
                    pdl.set_enabled(level > 0, level=level)
                    graphs[level], logits[level] = capture_with_logits(full(mb))
                pdl.set_enabled(False)
                times: dict[int, list[float]] = {level: [] for level in levels}
                for _ in range(3):
                    for level, g in graphs.items():
                        times[level].append(bench_ms(g.replay))
                row: dict = {f"level{lv}_ms": [round(t, 4) for t in ts] for lv, ts in times.items()}
                for level in levels[1:]:
                    row[f"level{level}_over_off"] = round(sorted(times[level])[1] / sorted(times[0])[1], 4)
                    row[f"level{level}_same_logits"] = bool(torch.equal(logits[0], logits[level]))
                if batch == 1 and ctx == 640:
                    row["profile_level1"] = profile_graph(graphs[1], out, "b1pdl")
                figp[f"B{batch}_L{ctx}"] = row
                del graphs, logits
        save("pdl", figp)

    # 1e. L2 prefetch of each GEMM's leading weight bytes during the small kernels before it (kernels/l2_prefetch.py):
    #     the whole forward + LM head captured with each prefetch config, replayed in turn (3 rounds); logits
    #     compared with no prefetch; the batch-1 graph's profile with and without
    if "l2pf" in phases:
        figl: dict = {}
        variants = {"off": None, **{label: l2_prefetch.PrefetchConfig(**kw) for label, kw in L2PF_VARIANTS.items()}}
        with torch.inference_mode():
            for batch, ctx in ((1, 640), (1, 4096), (8, 640), (32, 640)):
                mb = Batch(batch, ctx, 1, width, "cuda")
                if batch > 1:  # the default and the off graph only
                    chosen = {k: v for k, v in variants.items() if k in ("off", "rows8_64k", "rows16_64k")}
                else:
                    chosen = variants
                graphs, logits = {}, {}
                for label, pcfg in chosen.items():
                    model.l2_prefetcher = (None if pcfg is None else
                                           l2_prefetch.L2Prefetcher(replace(pcfg, max_tokens=64), "cuda"))
                    graphs[label], logits[label] = capture_with_logits(full(mb))
                model.l2_prefetcher = None
                row, med = replay_in_turn(graphs, logits)
                if batch == 1 and ctx == 640:
                    best = min((lb for lb in graphs if lb != "off"), key=med.get)
                    row["best"] = best
                    row["profile_off"] = profile_graph(graphs["off"], out, "b1l2off")
                    row["profile_best"] = profile_graph(graphs[best], out, "b1l2best")
                figl[f"B{batch}_L{ctx}"] = row
                save("l2_prefetch", figl)
                del graphs, logits

    # 1g. (streams) the projections cut into parts on side streams (StreamedGemms): whole forward + LM head, graph
    #     replay in turn (3 rounds) against one GEMM per projection, logits compared
    if "streams" in phases:
        figs: dict = {"per_projection_us": gemv_streams_table(copy_tbs)}
        save("gemm_streams", figs)
        plain_f = fused.F
        variants = {"off": None, "linear2": (2, True, False), "rows2": (2, False, True), "both2": (2, True, True),
                    "both4": (4, True, True)}
        with torch.inference_mode():
            for batch, ctx in ((1, 640), (1, 4096), (8, 640)):
                mb = Batch(batch, ctx, 1, width, "cuda")
                graphs, logits = {}, {}
                for label, spec in variants.items():
                    if spec is not None:
                        g = StreamedGemms(spec[0])
                        if spec[1]:
                            fused.F = LinearShim(g)
                        if spec[2]:
                            fused._row_projection = g.row_projection
                    graphs[label], logits[label] = capture_with_logits(full(mb))
                    fused.F, fused._row_projection = plain_f, ROW_PROJECTION
                row, med = replay_in_turn(graphs, logits)
                if batch == 1 and ctx == 640:
                    best = min((lb for lb in graphs if lb != "off"), key=med.get)
                    row["best"] = best
                    row["profile_best"] = profile_graph(graphs[best], out, "b1streams")
                figs[f"B{batch}_L{ctx}"] = row
                save("gemm_streams", figs)
                del graphs, logits

    # 1f. several decode steps in one graph: K forwards chained through the in-graph argmax (each step embeds the
    #     token the previous one picked, as the engine's fed inputs do), replay time per forward against K = 1;
    #     and K = 1 replayed the engine's way, between a host-to-device copy of its inputs and a device-to-host
    #     copy of its token, the host one step ahead
    if "multistep" in phases:
        figm: dict = {}
        with torch.inference_mode():
            for batch, ctx in ((1, 640), (1, 4096), (8, 640), (64, 640)):
                mb = Batch(batch, ctx, 1, width, "cuda")
                tokens = torch.zeros(batch, dtype=torch.int64, device="cuda")
                src = torch.arange(batch, dtype=torch.int32, device="cuda")

                def chain(k: int, mb=mb, tokens=tokens, src=src):
                    def fn():
                        for _ in range(k):
                            hidden = fused.forward(model, mb.input_ids, mb.positions, kv, mb.meta, backend,
                                                   fed=(src, tokens))
                            argmax_rows(model.logits(hidden), out=tokens)
                    return fn
                graphs = {k: graph_of(chain(k)) for k in (1, 2, 4, 8)}
                times: dict[int, list[float]] = {k: [] for k in graphs}
                for _ in range(3):
                    for k, g in graphs.items():
                        times[k].append(bench_ms(g.replay) / k)
                row: dict = {f"K{k}_ms_per_step": [round(t, 4) for t in ts] for k, ts in times.items()}
                one = sorted(times[1])[1]
                for k in graphs:
                    row[f"K{k}_over_K1"] = round(sorted(times[k])[1] / one, 4)
                if batch == 1 and ctx == 640:
                    row["engine_like_ms_per_step"] = engine_like_steps(graphs[1], batch, width, tokens)
                    row["gaps_between_replays_us"] = replay_gaps(graphs[1], out)
                figm[f"B{batch}_L{ctx}"] = row
                save("multistep", figm)
                del graphs

    # 3. batch-1 decode attention by split count: 32 layers' caches in one graph
    fig3 = {}
    for ctx in ((640, 4096) if "splits" in phases else ()):
        mb = Batch(1, ctx, 1, width, "cuda")
        qkv = torch.randn((1, 48, 128), device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
        for splits in (4, 8, 16, 32):
            g = graph_of(lambda: [decode_attention(q, kv.k[i], kv.v[i], mb.page_table, mb.seq_lens, splits)
                                  for i in range(cfg.num_layers)])
            fig3[f"L{ctx}_splits{splits}_us_per_layer"] = round(bench_ms(g.replay) * 1e3 / cfg.num_layers, 2)
            g = graph_of(lambda: [decode_attention_rope(q, k, v, mb.positions, model.inv_freq, kv.k[i], kv.v[i],
                                                        mb.slots, mb.page_table, mb.seq_lens, splits)
                                  for i in range(cfg.num_layers)])
            fig3[f"L{ctx}_splits{splits}_rope_fused_us_per_layer"] = round(
                bench_ms(g.replay) * 1e3 / cfg.num_layers, 2)
            del g
    if fig3:
        save("batch1_attention_splits", fig3)

    # 4. one batch vs two micro-batches on two streams
    fig4 = {}
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for batch, ctx in (((128, 640), (256, 1504), (384, 1504)) if "micro" in phases else ()):
        whole = Batch(batch, ctx, 1, width, "cuda")
        half = batch // 2
        halves = [Batch(half, ctx, 1, width, "cuda"), Batch(half, ctx, 1 + whole.num_pages // 2, width, "cuda")]
        row = {}
        with torch.inference_mode():
            g = graph_of(full(whole))
            row["one_batch_ms"] = round(bench_ms(g.replay), 3)
            del g
            for label, strs, alt in (("two_halves_one_stream_ms", [streams[0], streams[0]], False),
                                     ("two_streams_free_ms", streams, False),
                                     ("two_streams_alternating_ms", streams, True)):
                g = graph_of(lambda: split_forward(model, kv, backend, halves, strs, alt))
                row[label] = round(bench_ms(g.replay), 3)
                del g
            # the parts of one layer at the whole batch: attention core alone, GEMMs alone
            layer = model.model.layers[0]
            attn = layer.self_attn
            x = torch.randn((batch, 4096), device="cuda", dtype=torch.bfloat16)
            qkv = F.linear(x, attn.qkv_weight).view(batch, 48, 128)
            g = graph_of(lambda: [backend.forward_rope(i, qkv[:, :32], qkv[:, 32:40], qkv[:, 40:], whole.positions,
                                                       model.inv_freq, kv, whole.meta) for i in range(32)])
            row["attention_32_layers_ms"] = round(bench_ms(g.replay), 3)
            del g
            mlps = [lay.mlp for lay in model.model.layers]
            g = graph_of(lambda: [F.linear(silu_mul(F.linear(F.linear(F.linear(x, lay.self_attn.qkv_weight)[:, :4096],
                                                                            lay.self_attn.o_proj.weight),
                                                                   m.gate_up_weight)), m.down_proj.weight)
                                  for lay, m in zip(model.model.layers, mlps)])
            row["gemms_32_layers_ms"] = round(bench_ms(g.replay), 3)
            del g
        kv_bytes = batch * ctx * 131072
        row["roofline_ms"] = round((16.06e9 + kv_bytes) / (copy_tbs * 1e12) * 1e3, 3)
        fig4[f"B{batch}_L{ctx}"] = row
        save("micro_batches", fig4)

    # 8. the KV cache in FP8 (EngineConfig.kv_cache_dtype="fp8") vs bf16: whole-forward graph replay by batch and
    #    context, and the decode attention alone (32 layers in one graph); the bf16 pool is freed before the FP8
    #    one is made (last phase). NOTE: run (d) of 2026-12-03 also timed the attention with its products
    #    transposed (K and V as the dots' first operands): slower for both dtypes, and dropped.
    if "fp8kv" in phases:
        shapes = ((1, 640), (64, 1504), (128, 640), (256, 1504), (384, 1504))
        figf: dict = {}
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        for label in ("bfloat16", "fp8"):
            if label == "fp8":
                del kv
                torch.cuda.empty_cache()
                kv = KVCache(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float8_e4m3fn,
                             "cuda")
                for pool in (kv.k, kv.v):  # N(0, 1) as the bf16 pool's, one layer at a time
                    for layer in pool:
                        layer.copy_(torch.randn(layer.shape, device="cuda", dtype=torch.bfloat16))
            with torch.inference_mode():
                for batch, ctx in shapes:
                    mb = Batch(batch, ctx, 1, width, "cuda")
                    row = figf.setdefault(f"B{batch}_L{ctx}", {})
                    g = graph_of(full(mb))
                    row[f"{label}_forward_ms"] = round(bench_ms(g.replay), 4)
                    del g
                    qkv = torch.randn((batch, 48, 128), device="cuda", dtype=torch.bfloat16)
                    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
                    splits = num_splits_for(batch, cfg.num_kv_heads, num_sms)
                    g = graph_of(lambda: [decode_attention_rope(q, k, v, mb.positions, model.inv_freq, kv.k[i],
                                                                kv.v[i], mb.slots, mb.page_table, mb.seq_lens, splits)
                                          for i in range(cfg.num_layers)])
                    row[f"{label}_attention_32_layers_ms"] = round(bench_ms(g.replay), 4)
                    del g
        for batch, ctx in shapes:
            row = figf[f"B{batch}_L{ctx}"]
            row["forward_ratio_fp8_over_bf16"] = round(row["fp8_forward_ms"] / row["bfloat16_forward_ms"], 4)
            row["kv_read_ms_at_copy_bf16"] = round(batch * ctx * 131072 / (copy_tbs * 1e12) * 1e3, 3)
            row["kv_read_ms_at_copy_fp8"] = round(batch * ctx * 65536 / (copy_tbs * 1e12) * 1e3, 3)
        save("fp8_kv_cache", figf)
    if "l2pf_engine" in phases:  # the engine with phase l2pf's fastest batch-1 config (or the default)
        pcfg = l2_prefetch.DEFAULT_CONFIG
        if "l2pf" in phases:
            pcfg = l2_prefetch.PrefetchConfig(**L2PF_VARIANTS[record["phases"]["l2_prefetch"]["B1_L640"]["best"]])
        del model, kv
        gc.collect()
        torch.cuda.empty_cache()
        save("engine_batch1_l2_prefetch", engine_batch1_prefetch(pcfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
