"""The H200 suite in one device call: GPU kernel tests, each kernel's row of bench/kernel_table.py (time inside a
CUDA graph, bandwidth and error on Llama-3.1-8B shapes), then
the engine on random:llama3-8b (batch-1 TPOT, W0 against transformers generate() in the same run, W1),
every figure against the memory roofline. Writes JSON (after every phase, so a cut-off run keeps its figures).

    python -m bench.gpu_suite --out $OUT [--w1-requests 1000] [--time-budget-s 540]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import kernel_table
from bench.timing import copy_bandwidth, time_gpu

WEIGHT_BYTES = 16.06e9  # Llama-3.1-8B bf16, BENCHMARKS.md's roofline definition
KV_BYTES_PER_TOKEN = 131072


class Suite:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.start, self.budget_s = out, time.perf_counter(), budget_s
        self.record: dict = {"command": "python -m bench.gpu_suite " + " ".join(sys.argv[1:]),
                             "hardware": torch.cuda.get_device_name(), "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%d"), "model": "random:llama3-8b", "phases": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def save(self, name: str, figures) -> None:
        self.record["phases"][name] = figures
        self.record["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / "gpu_suite.json").write_text(json.dumps(self.record, indent=2, default=str))
        print(f"[{self.elapsed():6.1f}s] {name}: {json.dumps(figures, default=str)[:1500]}", flush=True)


class JitCompiles:
    """The Triton kernels compiled (missed in memory) since the last take(), and the seconds spent: a timed run that
    compiles pays for it, so this says whether compiling is part of a run's time."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seconds, self._started = 0.0, 0.0
        try:
            from triton import knobs
        except ImportError:  # a Triton without hooks: nothing is counted
            return
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after

    def _before(self, *, fn, **_) -> None:  # must return a falsy value, or Triton skips the compilation
        self.counts[fn.name] = self.counts.get(fn.name, 0) + 1
        self._started = time.perf_counter()

    def _after(self, **_) -> None:
        self.seconds += time.perf_counter() - self._started

    def take(self) -> dict:
        taken = {"kernels": dict(sorted(self.counts.items())), "seconds": round(self.seconds, 2)}
        self.counts, self.seconds = {}, 0.0
        return taken


def run_gpu_tests(out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/kernels", "-p", "no:cacheprovider",
                           "-o", "timeout=300"],
                          capture_output=True, text=True)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    return {"returncode": proc.returncode, "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def kernel_bandwidth() -> dict:
    """The copy ceiling, then every kernel's row of bench/kernel_table.py (GPU time per call inside a CUDA graph,
    bytes over it against the copy ceiling, error against its reference)."""
    copy_tbs = copy_bandwidth()
    return {"copy_1GiB": {"tb_s": round(copy_tbs, 3)}, **kernel_table.table(copy_tbs=copy_tbs)}


def make_engine(loaded, max_num_seqs: int, chunk: int, graphs: bool = True, kv_cache_dtype: str = "auto",
                gemv_max_tokens: int | None = None):
    from services.gpu_worker.engine import Engine
    from services.gpu_worker.engine_config import EngineConfig

    config = EngineConfig(model="random:llama3-8b", device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=chunk, max_model_len=4096, enable_prefix_cache=False,
                          enable_cuda_graphs=graphs, kv_cache_dtype=kv_cache_dtype, gemv_max_tokens=gemv_max_tokens)
    return Engine(config, loaded=loaded)


def run_timed(engine, prompts, output_len: int, deadline: float | None = None) -> dict:
    """All prompts at once, greedy, EOS ignored. Per decode-only (graph) step: B, sum of seq_lens, seconds."""
    from services.gpu_worker.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{engine._next_seq_id}-{i}", prompt, params)
    num_out, steps, is_cut = 0, [], False
    graphs = engine.graphs
    while engine.has_unfinished():
        if deadline is not None and time.perf_counter() > deadline:
            is_cut = True
            break
        running = engine.policy.running
        batch, kv_tokens = len(running), sum(s.num_computed + 1 for s in running)
        replays = graphs.num_replays if graphs else 0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if graphs and graphs.num_replays > replays:
            steps.append((batch, kv_tokens, dt))
        for out in outs:
            num_out += len(out.token_ids)
            if out.finish_reason is not None:
                engine.release_finished(out.request_id)
    if is_cut:
        for rid in list(engine._requests):
            engine.abort(rid)
            engine.release_finished(rid)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "num_output_tokens": num_out, "output_tok_s": num_out / seconds,
            "is_cut_short": is_cut, "decode_steps": steps}


def summarise_steps(steps: list, copy_tbs: float, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN) -> dict:
    """Decode steps against the roofline: (weights + context tokens × KV bytes per token) / copy bandwidth."""
    if not steps:
        return {}
    ratios = [dt / ((WEIGHT_BYTES + kv * kv_bytes_per_token) / (copy_tbs * 1e12)) for _, kv, dt in steps]
    times = [dt for _, _, dt in steps]
    batches = [b for b, _, _ in steps]
    return {"num_decode_steps": len(steps), "median_step_ms": round(statistics.median(times) * 1e3, 3),
            "median_batch": statistics.median(batches), "max_batch": max(batches),
            "median_step_over_roofline": round(statistics.median(ratios), 3)}


def graph_replay_ms(engine, bucket: int) -> float:
    """GPU time of one captured decode forward + LM head at `bucket` rows of 1-token context (weights only)."""
    graph = engine.graphs.graphs[bucket]
    return time_gpu(graph.replay) * 1e3


def hf_generate(loaded, prompts, output_len: int) -> dict:
    """transformers generate() on the very same weight tensors (assigned, not copied), batch = len(prompts)."""
    import transformers

    from services.gpu_worker.model.loader import hf_config_dict

    cfg = dict(hf_config_dict(loaded.config))
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False, assign=True)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    model.eval()
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)
    model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    num_out = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del model, out
    return {"seconds": seconds, "num_output_tokens": num_out, "output_tok_s": num_out / seconds}


def prompts_for(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def main() -> int:
    from services.gpu_worker.gemv_option import parse_gemv_max_tokens

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--time-budget-s", type=float, default=540)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--w0-requests", type=int, default=128)
    p.add_argument("--w1-requests", type=int, default=1000)
    p.add_argument("--w1-max-seqs", default="256",
                   help="max_num_seqs of W1; a comma-separated list runs W1 once per value, in turn, on one engine "
                        "(a value given twice runs twice)")
    p.add_argument("--w1-warmup-requests", type=int, default=0,
                   help="untimed W1-shaped requests (1000 → 8 tokens) before W1, at its largest max_num_seqs: a "
                        "first W1 on an engine spent 1.5-3.7 s more in its steps with prefill")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--peer-repeats", type=int, default=2, help="timed transformers generate() runs (median)")
    p.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype: auto or fp8")
    p.add_argument("--gemv-max-tokens", type=parse_gemv_max_tokens, default=None,
                   help="EngineConfig.gemv_max_tokens: steps of at most this many tokens on the Triton GEMV "
                        "(0: cuBLAS; auto, the default: 1)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = Suite(out, args.time_budget_s)
    jit = JitCompiles()
    if not args.skip_tests:
        suite.save("gpu_tests", run_gpu_tests(out))
    kernels = kernel_bandwidth()
    copy_tbs = kernels["copy_1GiB"]["tb_s"]
    suite.save("kernels", kernels)
    w1_seqs = [int(x) for x in args.w1_max_seqs.split(",")]

    from services.gpu_worker.model.loader import load_model

    loaded = load_model("random:llama3-8b", dtype=torch.bfloat16, device="cuda", seed=0)
    vocab = loaded.config.vocab_size
    w0_prompts = prompts_for(args.w0_requests, 512, vocab, 0)
    # The peer first, while the GPU's memory is free (the engine's KV pool takes most of it); its run-to-run
    # spread was 37 % between two device calls, so the reference is the median of several runs.
    peer_runs = [hf_generate(loaded, w0_prompts, 256) for _ in range(args.peer_repeats)]
    peer = {"runs_output_tok_s": [round(r["output_tok_s"], 1) for r in peer_runs],
            "median_output_tok_s": round(statistics.median(r["output_tok_s"] for r in peer_runs), 1)}
    suite.save("w0_transformers", peer)
    gc.collect()
    torch.cuda.empty_cache()

    t0 = time.perf_counter()
    engine = make_engine(loaded, max_num_seqs=max(args.w0_requests, *w1_seqs), chunk=args.chunk,
                         kv_cache_dtype=args.kv_cache_dtype, gemv_max_tokens=args.gemv_max_tokens)
    setup_s = time.perf_counter() - t0
    kv_bytes = KV_BYTES_PER_TOKEN * engine.kv.k.element_size() // 2  # the constant is bf16's
    replay = {b: round(graph_replay_ms(engine, b), 3) for b in (1, 8, 64, 128, 256) if b in engine.graphs.graphs}
    from services.gpu_worker.kernels import decode_attention
    from services.gpu_worker.kv_cache import is_v_pairs

    suite.save("engine_setup", {"seconds_incl_graph_capture": round(setup_s, 1), "num_pages": engine.num_pages,
                                "warmup_seconds": round(engine.warmup_seconds, 2), "jit_compiles": jit.take(),
                                "kv_cache_dtype": str(engine.kv.dtype),
                                "gemv_max_tokens": engine.model.gemv_max_tokens,
                                "v_cache_layout": "key pairs" if is_v_pairs(engine.kv.dtype) else "rows",
                                "decode_tile": decode_attention.TILE, "decode_tile_fp8": decode_attention.TILE_FP8,
                                "decode_tile_fp8_few": decode_attention.TILE_FP8_FEW,
                                "decode_tile_fp8_few_programs": decode_attention.FEW_PROGRAMS,
                                "graph_buckets": engine.graphs.buckets, "graph_replay_ms_1token_ctx": replay,
                                "weights_roofline_ms": round(WEIGHT_BYTES / (copy_tbs * 1e12) * 1e3, 3)})

    b1_prompt = prompts_for(1, 512, vocab, 1)
    run_timed(engine, b1_prompt, 8)  # warm-up
    batch1 = {}
    for overlap in (False, True):  # the same engine, step mode switched between runs
        engine.is_overlapped = overlap
        b1 = run_timed(engine, b1_prompt, 256)
        tpot = statistics.median(dt for _, _, dt in b1["decode_steps"])
        batch1["overlap" if overlap else "serial"] = {
            "tpot_ms": round(tpot * 1e3, 3), "tok_s": round(1 / tpot, 1), "roofline_ms": 3.76,
            "tpot_over_roofline": round(tpot * 1e3 / 3.76, 3),
            **summarise_steps(b1["decode_steps"], copy_tbs, kv_bytes)}
    batch1["jit_compiles_since_start"] = jit.take()
    suite.save("batch1_decode", batch1)

    w0_fig: dict = {"transformers": peer}
    for overlap, repeats in ((True, 2), (False, 1)):
        engine.is_overlapped = overlap
        runs, compiles = [], []
        for _ in range(repeats):
            runs.append(run_timed(engine, w0_prompts, 256))
            compiles.append(jit.take())
        best = sorted(runs, key=lambda r: r["seconds"])[0]
        w0_fig["overlap" if overlap else "serial"] = {
            **{k: v for k, v in best.items() if k != "decode_steps"}, "all_seconds": [r["seconds"] for r in runs],
            "jit_compiles": compiles,
            "decode_steps_seconds": round(sum(dt for _, _, dt in best["decode_steps"]), 3),
            **summarise_steps(best["decode_steps"], copy_tbs, kv_bytes)}
    w0_fig["ratio_vs_peer_median"] = round(w0_fig["overlap"]["output_tok_s"] / peer["median_output_tok_s"], 2)
    w0_fig["overlap_over_serial_tok_s"] = round(w0_fig["overlap"]["output_tok_s"] / w0_fig["serial"]["output_tok_s"], 3)
    suite.save("w0", w0_fig)

    engine.is_overlapped = True
    deadline = suite.start + args.time_budget_s
    w1_prompts = prompts_for(args.w1_requests, 1000, vocab, 2)
    if args.w1_warmup_requests:
        engine.policy.max_num_seqs = max(w1_seqs)
        warm = run_timed(engine, prompts_for(args.w1_warmup_requests, 1000, vocab, 3), 8)
        suite.save("w1_warmup", {"requests": args.w1_warmup_requests, "seconds": round(warm["seconds"], 2),
                                 "jit_compiles": jit.take()})
    # A repeated value runs again on the same engine: its record's key gets the run's number (W1 moved by 6 %
    # between device calls)
    names = [f"w1_max_seqs_{m}" + (f"_run{w1_seqs[:i + 1].count(m)}" if w1_seqs.count(m) > 1 else "")
             for i, m in enumerate(w1_seqs)]
    for max_seqs, name in zip(w1_seqs, names):
        engine.policy.max_num_seqs = max_seqs
        preempted = engine.policy.num_preemptions
        w1 = run_timed(engine, w1_prompts, 1000, deadline=deadline)
        w1_fig = {k: v for k, v in w1.items() if k != "decode_steps"}
        w1_fig.update(summarise_steps(w1["decode_steps"], copy_tbs, kv_bytes))
        w1_fig["decode_steps_seconds"] = round(sum(dt for _, _, dt in w1["decode_steps"]), 3)
        w1_fig["num_requests"], w1_fig["max_num_seqs"] = args.w1_requests, max_seqs
        w1_fig["num_preemptions"] = engine.policy.num_preemptions - preempted
        w1_fig["jit_compiles"] = jit.take()
        suite.save("w1" if len(w1_seqs) == 1 else name, w1_fig)
    print(json.dumps({k: v for k, v in suite.record["phases"].items() if k != "kernels"}, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
