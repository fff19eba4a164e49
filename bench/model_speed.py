"""Batch-1 TPOT of a preset model against its own memory roofline, and where a step's GPU time goes, on CUDA.

The roofline of a batch-1 decode step is the bytes it must read over the same run's copy bandwidth: every weight
but the embedding table (one row read; a tied table is read whole as the LM head), a mixture-of-experts layer's
experts counted for the ones the batch routes to (top_k of E at one token), and the KV cache of the context.
The kernel shares come from torch.profiler over decode steps (CUDA graph replays), grouped by kernel family.

    python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:torch_routing,gemma2-9b --out $OUT

A preset suffixed `:torch_routing` runs the MoE router and expert sort as torch ops (softmax, topk, division; the
dozen ops of fused_moe.align_by_expert) instead of kernels/moe_routing.py's two launches: the A/B of that lever.
A preset suffixed `:no_pdl` launches the kernels without programmatic dependent launch (kernels/pdl.py), its A/B;
`:pdl_wait_only` with it, but each kernel lets the next one start only when it ends. `:w4a16_chunks` loads an INT4
model's one-token scales and zeros once a chunk of 4 words (kernels/w4a16.py's CHUNK_SCALES), its A/B.
A preset suffixed `@METHOD` (fp8, awq, gptq) quantizes its linear layers on load, as `serve --quantization METHOD`
does (issue 25); its roofline counts the quantized weights' bytes (packed words and scales):

    python -m bench.model_speed --presets llama3-8b,llama3-8b@fp8,llama3-8b@awq --out $OUT
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.gpu_suite import JitCompiles, graph_replay_ms, prompts_for, run_timed
from bench.timing import copy_bandwidth

# kernel-name fragments → family, first match wins (names of the Triton kernels in services/gpu_worker/kernels)
FAMILIES = (("moe_gemm", "moe grouped GEMM"), ("_gate_up_kernel", "moe GEMV"), ("_down_kernel", "moe GEMV"),
            ("route_topk", "moe routing"), ("align_small", "moe routing"), ("_chunk_", "moe routing"),
            ("norm_router", "RMSNorm + router"),
            ("w4a16", "W4A16 GEMM"), ("gemv", "GEMV"), ("decode", "attention"), ("extend", "attention"),
            ("rope", "attention"), ("rms_norm", "RMSNorm"), ("silu", "SiLU·mul"), ("gemm", "cuBLAS GEMM"),
            ("cutlass", "cuBLAS GEMM"), ("sm90", "cuBLAS GEMM"), ("argmax", "sampling"))


def family(name: str) -> str:
    low = name.lower()
    return next((fam for frag, fam in FAMILIES if frag in low), "other (torch elementwise, sort, softmax, top-k)")


def expected_experts_hit(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts a batch reads under uniform routing: E · (1 − (1 − k/E)^T)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def step_bytes(model, num_tokens: int, context_tokens: int, kv_bytes_per_token: int) -> float:
    """Bytes a decode step of num_tokens sequences must read: weights (experts: those hit) + their KV."""
    cfg = model.config
    total = 0.0
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if _is_weight_buffer(n))]
    for name, p in tensors:
        size = p.numel() * p.element_size()  # each tensor once: fused q/k/v and gate/up are views, not listed
        if "experts." in name:
            size *= expected_experts_hit(cfg.num_experts, cfg.num_experts_per_tok, num_tokens) / cfg.num_experts
        elif name.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings:
            size = num_tokens * p.shape[1] * p.element_size()  # rows looked up; the LM head is its own matrix
        total += size
    return total + context_tokens * kv_bytes_per_token


def _is_weight_buffer(name: str) -> bool:
    """A quantized linear layer's weight tensors (quant/linear.py keeps them as buffers), not caches or tables."""
    return name.rsplit(".", 1)[-1] in ("qweight", "weight_scale", "scales", "zeros", "perm", "bias")


def kv_bytes_per_token(engine) -> int:
    cfg = engine.model.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * engine.kv.k.element_size()


def profile_steps(engine, prompts: list[list[int]], num_steps: int, output_len: int) -> dict:
    """GPU time by kernel family over num_steps decode steps once every prompt decodes."""
    from torch.profiler import ProfilerActivity, profile

    from services.gpu_worker.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{engine._next_seq_id}-{i}", prompt, params)
    while engine.policy.waiting or any(s.num_computed < s.num_prompt_tokens for s in engine.policy.running):
        _finish(engine, engine.step())
    for _ in range(3):
        _finish(engine, engine.step())
    _sync()
    on_gpu = torch.cuda.is_available()  # the CPU (a smoke run) profiles the host's ops
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            _finish(engine, engine.step())
        _sync()
    batch = len(engine.policy.running)
    for rid in list(engine._requests):
        engine.abort(rid)
        engine.release_finished(rid)
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = (getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)) if on_gpu else \
            evt.self_cpu_time_total
        if us and not evt.key.startswith(("cudaGraphLaunch", "Memcpy", "Memset")):
            by_family[family(evt.key)] += us
            by_kernel[evt.key] += us
    total = sum(by_family.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {"batch": batch, "num_steps": num_steps, "gpu_ms_per_step": round(total / num_steps / 1e3, 3),
            "share": {k: round(v / total, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])} if total
            else {}, "top_kernels_us_per_step": {k[:90]: round(v / num_steps, 1) for k, v in top}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _finish(engine, outs) -> None:
    for out in outs:
        if out.finish_reason is not None:
            engine.release_finished(out.request_id)


@contextlib.contextmanager
def variant(name: str):
    """For the engine built inside: torch_routing: moe_routing's kernels swapped for the torch ops they replace;
    no_pdl: the kernels launched without programmatic dependent launch (kernels/pdl.py); pdl_wait_only: with it,
    without the early release of the next kernel; w4a16_chunks: w4a16.CHUNK_SCALES on."""
    if not name:
        yield
        return
    if name == "w4a16_chunks":
        from services.gpu_worker.kernels import w4a16

        w4a16.CHUNK_SCALES = True
        try:
            yield
        finally:
            w4a16.CHUNK_SCALES = False
        return
    if name in ("no_pdl", "pdl_wait_only"):
        from services.gpu_worker.kernels import pdl

        with pdl.disabled() if name == "no_pdl" else pdl.wait_only():
            yield
        return
    assert name == "torch_routing", name
    from services.gpu_worker.kernels import fused_moe, moe_routing

    saved = moe_routing.route_topk, fused_moe.SMALL_PAIRS
    moe_routing.route_topk, fused_moe.SMALL_PAIRS = moe_routing.route_topk_ref, 0
    try:
        yield
    finally:
        moe_routing.route_topk, fused_moe.SMALL_PAIRS = saved


def measure(preset: str, copy_tbs: float, jit: JitCompiles, max_num_seqs: int, quantization: str | None) -> dict:
    from services.gpu_worker.engine import Engine
    from services.gpu_worker.engine_config import EngineConfig

    t0 = time.perf_counter()
    config = EngineConfig(model=f"random:{preset}", device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=8192, max_model_len=4096, enable_prefix_cache=False,
                          quantization=quantization, seed=0)
    engine = Engine(config)  # loads its own weights: one copy in memory (a 30B MoE fits an 80 GB card)
    setup = {"seconds": round(time.perf_counter() - t0, 1), "num_pages": engine.num_pages,
             "jit_compiles": jit.take(), "graph_buckets": engine.graphs.buckets if engine.graphs else None,
             "is_fused": engine.model.is_fused, "gemv_max_tokens": engine.model.gemv_max_tokens}
    vocab = engine.model.config.vocab_size
    kv_tok = kv_bytes_per_token(engine)
    prompt = prompts_for(1, 512, vocab, 1)
    run_timed(engine, prompt, 8)
    b1 = run_timed(engine, prompt, 256)
    steps = b1["decode_steps"]
    tpot = statistics.median(dt for _, _, dt in steps)
    mid_context = statistics.median(kv for _, kv, _ in steps)
    roofline = step_bytes(engine.model, 1, mid_context, kv_tok) / (copy_tbs * 1e12)
    replay_1 = graph_replay_ms(engine, 1) if engine.graphs and 1 in engine.graphs.graphs else None
    batch1 = {"tpot_ms": round(tpot * 1e3, 3), "tok_s": round(1 / tpot, 1),
              "roofline_ms": round(roofline * 1e3, 3), "tpot_over_roofline": round(tpot / roofline, 3),
              "bytes_per_step_gb": round(step_bytes(engine.model, 1, mid_context, kv_tok) / 1e9, 3),
              "graph_replay_ms_1token_ctx": None if replay_1 is None else round(replay_1, 3),
              "num_decode_steps": len(steps), "jit_compiles": jit.take()}
    profiles = {}
    for batch in (1, 64, 256):
        if batch <= max_num_seqs:
            profiles[f"batch_{batch}"] = profile_steps(engine, prompts_for(batch, 512, vocab, 10 + batch), 20, 64)
    total_params = sum(p.numel() for p in engine.model.parameters())
    result = {"preset": preset, "quantization": quantization, "parameters": total_params, "setup": setup, "batch1_decode": batch1,
              "profiles": profiles, "jit_compiles_after": jit.take()}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="qwen3-30b-a3b,qwen3-30b-a3b:torch_routing,gemma2-9b")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jit = JitCompiles()
    copy_tbs = copy_bandwidth()
    record = {"command": "python -m bench.model_speed " + " ".join(sys.argv[1:]),
              "hardware": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "copy_tb_s": round(copy_tbs, 3), "models": {}}
    for spec in args.presets.split(","):
        preset, _, variant_name = spec.partition(":")
        preset, _, method = preset.partition("@")
        try:
            with variant(variant_name):
                record["models"][spec] = measure(preset, copy_tbs, jit, args.max_num_seqs, method or None)
        except Exception as exc:  # one model's failure must not lose the others' figures
            record["models"][spec] = {"error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            torch.cuda.empty_cache()
        (out / "model_speed.json").write_text(json.dumps(record, indent=2, default=str))
        print(spec, json.dumps(record["models"][spec], default=str)[:3000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
