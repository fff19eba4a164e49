"""Tensor parallelism on one host's GPUs (written for 2 × H200): TP=N greedy tokens against TP=1's on
random:llama3-8b, then batch-1 decode TPOT and W1-style throughput (every request at once, greedy, EOS
ignored) for TP=1 and TP=N. Each configuration runs in freshly spawned rank processes (parallel.launch), so
neither holds the other's GPU memory; the JSON under --out is rewritten after every configuration.

    python -m bench.tp_gpu --out $OUT [--tp 2] [--w1-requests 256] [--w1-output-len 1000] [--exact-check]
    python -m bench.tp_gpu --dry-run   # the plan as JSON, no GPU needed
    python -m bench.tp_gpu --device cpu --model random:tiny-llama --w1-requests 8 ...   # a CPU smoke run (gloo)

The token check: random weights give near-uniform logits, so two correct bf16 runs that sum in a different
order (TP's all_reduce) can pick different tokens where the top two are within rounding of each other. A
prompt passes when its tokens are equal, or when they first differ at such a near-tie (TP=1's top-2
logprob gap below --tie-logprob-gap). --exact-check repeats the check in float32 with the torch attention
backend and no CUDA graphs, where the tokens must be equal outright.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.parallel import LockstepEngine, follow, launch
from services.gpu_worker.request import SamplingParams

# Keep NVLink multicast off (the lending machines' rule: it can take the host's shared GPUs out of service).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LAUNCH_SLACK_S = 300.0  # a configuration's start-up (weights, Triton JIT, graph capture) beyond its run budget


def prompts_for(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def run_rank(spec: dict) -> dict | None:
    """One rank of one configuration: build the engine (its shard), run spec's phases; rank 0 returns figures."""
    started = time.perf_counter()
    config = EngineConfig(model=spec["model"], device=spec["device"], dtype=spec["dtype"],
                          attention_backend=spec["attention_backend"], enable_cuda_graphs=spec["cuda_graphs"],
                          max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["chunk"],
                          max_model_len=spec["max_model_len"], enable_prefix_cache=False,
                          tensor_parallel_size=spec["tp"])
    engine = Engine(config)
    if engine.tp is not None and not engine.tp.is_leader:
        follow(engine)
        return None
    driver = engine if engine.tp is None else LockstepEngine(engine)
    try:
        _synchronize(engine.device)
        figures: dict = {"tp": spec["tp"], "setup_s": round(time.perf_counter() - started, 1),
                         "num_pages": engine.num_pages, "cuda_graphs": engine.graphs is not None,
                         "overlap": engine.is_overlapped}
        if engine.device.type == "cuda":
            figures["gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        vocab = engine.model_config.vocab_size
        if "check" in spec["phases"]:
            figures["check"] = greedy_tokens(driver, prompts_for(spec["check_prompts"], spec["check_input_len"],
                                                                 vocab, 3), spec["check_output_len"])
        if "tpot" in spec["phases"]:
            prompt = prompts_for(1, spec["tpot_input_len"], vocab, 1)
            timed_run(driver, prompt, 8, deadline=None)  # warm-up
            run = timed_run(driver, prompt, spec["tpot_output_len"], deadline=None)
            figures["batch1"] = {"tpot_ms": round(run["tpot_median_s"] * 1e3, 3),
                                 "tok_s": round(1 / run["tpot_median_s"], 1), "seconds": round(run["seconds"], 3)}
        if "w1" in spec["phases"]:
            prompts = prompts_for(spec["w1_requests"], spec["w1_input_len"], vocab, 2)
            run = timed_run(driver, prompts, spec["w1_output_len"], deadline=time.perf_counter() + spec["w1_budget_s"])
            figures["w1"] = {key: value for key, value in run.items() if key != "tpot_median_s"}
            figures["w1"]["tpot_median_ms"] = round(run["tpot_median_s"] * 1e3, 3)
            figures["w1"]["num_preemptions"] = engine.policy.num_preemptions
        return figures
    finally:
        if isinstance(driver, LockstepEngine):
            driver.shutdown()


def greedy_tokens(driver: Engine | LockstepEngine, prompts: list[list[int]], output_len: int) -> list[dict]:
    """Per prompt: its greedy tokens, their logprobs, and the gap between the top two at each position."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=2)
    results = driver.generate(prompts, params)
    return [{"tokens": r.samples[0].token_ids, "logprobs": [lp.logprob for lp in r.samples[0].logprobs],
             "top2_gaps": [lp.top[0][1] - lp.top[1][1] for lp in r.samples[0].logprobs]} for r in results]


def timed_run(driver: Engine | LockstepEngine, prompts: list[list[int]], output_len: int,
              deadline: float | None) -> dict:
    """Every prompt at once, greedy, EOS ignored; output throughput and the median per-request TPOT
    ((last token − first token) / (tokens − 1)). Past the deadline the rest is aborted (is_cut_short)."""
    engine = driver.engine if isinstance(driver, LockstepEngine) else driver
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    _synchronize(engine.device)
    start = time.perf_counter()
    ids = [f"t{engine._next_seq_id}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        driver.add_request(request_id, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    num_out, is_cut, num_steps = 0, False, 0
    while driver.has_unfinished():
        if deadline is not None and time.perf_counter() > deadline:
            is_cut = True
            break
        outputs = driver.step()
        num_steps += 1
        now = time.perf_counter()
        for out in outputs:
            num_out += len(out.token_ids)
            first.setdefault(out.request_id, now)
            count = last.get(out.request_id, (now, 0))[1] + len(out.token_ids)
            last[out.request_id] = (now, count)
            if out.finish_reason is not None:
                driver.release_finished(out.request_id)
    if is_cut:
        for request_id in ids:
            driver.abort(request_id)
            driver.release_finished(request_id)
    _synchronize(engine.device)
    seconds = time.perf_counter() - start
    tpots = [(last[rid][0] - first[rid]) / (last[rid][1] - 1) for rid in first if last[rid][1] > 1]
    return {"seconds": round(seconds, 3), "num_requests": len(prompts), "num_output_tokens": num_out,
            "output_tok_s": round(num_out / seconds, 1), "num_steps": num_steps, "is_cut_short": is_cut,
            "tpot_median_s": statistics.median(tpots) if tpots else float("nan")}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_tokens(reference: list[dict], candidate: list[dict], tie_gap: float) -> dict:
    """Where candidate's greedy tokens first leave reference's, and whether that was at a near-tie."""
    rows = []
    for ref, got in zip(reference, candidate, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])) if a != b), None)
        agreed = len(ref["tokens"]) if first is None else first
        diffs = [abs(a - b) for a, b in zip(ref["logprobs"][:agreed], got["logprobs"][:agreed])]
        gap = None if first is None else ref["top2_gaps"][first]
        rows.append({"first_divergence": first, "top2_gap_there": gap,
                     "max_logprob_diff_before": max(diffs, default=0.0),
                     "passed": first is None or gap < tie_gap})
    return {"num_prompts": len(rows), "num_equal": sum(r["first_divergence"] is None for r in rows),
            "num_near_tie_divergences": sum(r["first_divergence"] is not None and r["passed"] for r in rows),
            "passed": all(r["passed"] for r in rows), "tie_logprob_gap": tie_gap, "per_prompt": rows}


def make_spec(args: argparse.Namespace, tp: int, phases: list[str], exact: bool = False) -> dict:
    return {"model": args.model, "device": args.device, "tp": tp, "phases": phases,
            "dtype": "float32" if exact else args.dtype, "attention_backend": "torch" if exact else "auto",
            "cuda_graphs": not (exact or args.no_cuda_graphs), "max_num_seqs": args.max_num_seqs,
            "chunk": args.chunk, "max_model_len": args.max_model_len, "check_prompts": args.check_prompts,
            "check_input_len": args.check_input_len, "check_output_len": args.check_output_len,
            "tpot_input_len": args.tpot_input_len, "tpot_output_len": args.tpot_output_len,
            "w1_requests": args.w1_requests, "w1_input_len": args.w1_input_len, "w1_output_len": args.w1_output_len,
            "w1_budget_s": args.w1_budget_s}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"), help="folder for tp_gpu.json")
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run of the script")
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager decode steps (e.g. if NCCL capture fails)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--check-prompts", type=int, default=8)
    p.add_argument("--check-input-len", type=int, default=128)
    p.add_argument("--check-output-len", type=int, default=64)
    p.add_argument("--tie-logprob-gap", type=float, default=0.05,
                   help="a bf16 divergence passes where TP=1's top-2 logprobs were closer than this")
    p.add_argument("--exact-check", action="store_true", help="also check in float32 (torch attention, no graphs)")
    p.add_argument("--tpot-input-len", type=int, default=512)
    p.add_argument("--tpot-output-len", type=int, default=256)
    p.add_argument("--w1-requests", type=int, default=256)
    p.add_argument("--w1-input-len", type=int, default=1000)
    p.add_argument("--w1-output-len", type=int, default=1000)
    p.add_argument("--w1-budget-s", type=float, default=150.0, help="W1 is cut (and marked so) after this long")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit (no GPU needed)")
    args = p.parse_args(argv)
    if args.tp < 2:
        p.error("--tp must be >= 2 (it is compared with TP=1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases = ["check", "tpot", "w1"]
    plan = {f"tp{tp}": make_spec(args, tp, phases) for tp in (1, args.tp)}
    if args.exact_check:
        plan.update({f"tp{tp}_float32": make_spec(args, tp, ["check"], exact=True) for tp in (1, args.tp)})
    if args.dry_run:
        print(json.dumps(plan, indent=1))
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"tp_gpu: needs {args.tp} CUDA devices, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    os.environ.update(NO_MULTICAST_ENV)  # the spawned ranks inherit it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"command": "python -m bench.tp_gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "hardware": (f"{torch.cuda.device_count()} × {torch.cuda.get_device_name()}"
                                 if args.device == "cuda" else f"cpu, {os.cpu_count()} cores"),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "plan": plan, "runs": {}}
    for name, spec in plan.items():
        started = time.perf_counter()
        try:
            record["runs"][name] = launch(spec["tp"], run_rank, spec, device_type=args.device,
                                          timeout_s=spec["w1_budget_s"] + LAUNCH_SLACK_S * (1 + spec["tp"]))
        except Exception as exc:  # noqa: BLE001 - keep the other configurations' figures
            record["runs"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                    "notes": list(getattr(exc, "__notes__", []))}
        record["runs"][name]["wall_s"] = round(time.perf_counter() - started, 1)
        record["summary"] = summarise(record["runs"], args)
        (out / "tp_gpu.json").write_text(json.dumps(record, indent=1, default=str))
        print(f"{name}: {json.dumps({k: v for k, v in record['runs'][name].items() if k != 'check'})[:1500]}",
              flush=True)
    print(json.dumps(record["summary"], indent=1))
    return 0 if record["summary"].get("check", {}).get("passed") else 1


def summarise(runs: dict, args: argparse.Namespace) -> dict:
    """The token checks, and TP=N against TP=1: TPOT speed-up at batch 1, W1 throughput ratio."""
    summary: dict = {}
    one, many = runs.get("tp1", {}), runs.get(f"tp{args.tp}", {})
    if "check" in one and "check" in many:
        compared = compare_tokens(one["check"], many["check"], args.tie_logprob_gap)
        summary["check"] = {k: v for k, v in compared.items() if k != "per_prompt"}
        summary["check"]["first_divergences"] = [r["first_divergence"] for r in compared["per_prompt"]]
    exact_one, exact_many = runs.get("tp1_float32", {}), runs.get(f"tp{args.tp}_float32", {})
    if "check" in exact_one and "check" in exact_many:
        compared = compare_tokens(exact_one["check"], exact_many["check"], tie_gap=0.0)
        summary["exact_check"] = {k: v for k, v in compared.items() if k != "per_prompt"}
    if "batch1" in one and "batch1" in many:
        summary["batch1_tpot_ms"] = {"tp1": one["batch1"]["tpot_ms"], f"tp{args.tp}": many["batch1"]["tpot_ms"],
                                     "speedup": round(one["batch1"]["tpot_ms"] / many["batch1"]["tpot_ms"], 3)}
    if "w1" in one and "w1" in many:
        summary["w1_output_tok_s"] = {"tp1": one["w1"]["output_tok_s"], f"tp{args.tp}": many["w1"]["output_tok_s"],
                                      "ratio": round(many["w1"]["output_tok_s"] / one["w1"]["output_tok_s"], 3),
                                      "is_cut_short": one["w1"]["is_cut_short"] or many["w1"]["is_cut_short"]}
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
