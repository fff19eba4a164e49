"""Offline engine benchmark (no HTTP): W0 against transformers generate() in the same run, W1, and the
W2 shared-prefix experiment (shared vs random system prompt, prefix cache on vs off).

    python -m bench.engine_offline --workload w0 --model bundled --num-requests 16 --input-len 128 --output-len 32
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import LoadedModel, load_model
from services.gpu_worker.request import SamplingParams


@dataclass
class RunFigures:
    seconds: float
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_p50_s: float | None  # None where not measured (transformers generate())
    ttft_p90_s: float | None

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.seconds


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int) -> RunFigures:
    """All prompts submitted at once; greedy, EOS ignored so every request makes output_len tokens."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    first_token: dict[str, float] = {}
    num_out = num_cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
            num_out += len(out.token_ids)
            if out.finish_reason is not None:
                num_cached += out.num_cached_tokens
                engine.release_finished(out.request_id)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ttfts = sorted(first_token.values())
    return RunFigures(seconds, num_out, sum(map(len, prompts)), num_cached,
                      _percentile(ttfts, 0.5), _percentile(ttfts, 0.9))


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def run_hf(loaded: LoadedModel, prompts: list[list[int]], output_len: int, device: str,
           dtype: torch.dtype) -> RunFigures:
    """transformers generate() at the same batch (prompts of equal length: no padding needed)."""
    from tests.reference import hf_model

    model = hf_model(loaded).to(device=device, dtype=dtype)
    input_ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  attention_mask=torch.ones_like(input_ids), pad_token_id=0)
    warm = input_ids[:, :8]
    model.generate(warm, max_new_tokens=2, do_sample=False, attention_mask=torch.ones_like(warm), pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    num_out = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return RunFigures(seconds, num_out, input_ids.numel(), 0, None, None)


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def shared_prefix_prompts(num_groups: int, per_group: int, prefix_len: int, question_len: int,
                          vocab: int, is_shared: bool, seed: int) -> list[list[int]]:
    """W2: num_groups system prompts, each followed by per_group questions (SGLang's generated-shared-prefix)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_groups):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        for _ in range(per_group):
            own = prefix if is_shared else [rng.randrange(vocab) for _ in range(prefix_len)]
            prompts.append(own + [rng.randrange(vocab) for _ in range(question_len)])
    return prompts


def make_engine(args: argparse.Namespace, loaded: LoadedModel, **overrides) -> Engine:
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype, **overrides)
    return Engine(config, loaded=loaded)


def bench_w0(args, loaded) -> dict:
    prompts = random_prompts(args.num_requests, args.input_len, loaded.config.vocab_size, args.seed)
    engine = make_engine(args, loaded, enable_prefix_cache=False)
    run_engine(engine, prompts[:2], 2)  # warm-up
    ours = [run_engine(engine, prompts, args.output_len) for _ in range(args.repeats)]
    result = {"radixserve": _median(ours)}
    if not args.no_peer:
        engine = None
        hf = [run_hf(loaded, prompts, args.output_len, args.resolved_device, args.torch_dtype)
              for _ in range(args.repeats)]
        result["transformers"] = _median(hf)
        result["ratio_output_tok_s"] = result["radixserve"]["output_tok_s"] / result["transformers"]["output_tok_s"]
    return result


def bench_w2(args, loaded) -> dict:
    """Cold variants submit every request at once into an empty cache. The engine has no in-batch
    prefix sharing: requests admitted in the same step all miss, so the cold shared+cache-on run can
    show no hits. The warm variant first computes each group's system prompt once (untimed)."""
    vocab = loaded.config.vocab_size
    shape = (args.num_groups, args.per_group, args.prefix_len, args.input_len)
    shared = shared_prefix_prompts(*shape, vocab, True, args.seed)
    distinct = shared_prefix_prompts(*shape, vocab, False, args.seed)
    system_prompts = [shared[g * args.per_group][: args.prefix_len] for g in range(args.num_groups)]
    variants = {"shared_prefix_cache_on": (shared, True, []), "random_prefix_cache_on": (distinct, True, []),
                "shared_prefix_cache_off": (shared, False, []),
                "shared_prefix_cache_warm": (shared, True, system_prompts)}
    result = {}
    for name, (prompts, cache_on, warm) in variants.items():
        runs = []
        for _ in range(args.repeats):
            engine = make_engine(args, loaded, enable_prefix_cache=cache_on)
            run_engine(engine, prompts[:1], 2)
            engine.cache.clear()
            if warm:
                run_engine(engine, warm, 1)
            runs.append(run_engine(engine, prompts, args.output_len))
        result[name] = _median(runs)
    on, off = result["shared_prefix_cache_on"], result["shared_prefix_cache_off"]
    warm_on = result["shared_prefix_cache_warm"]
    result["cached_token_fraction"] = on["num_cached_tokens"] / on["num_prompt_tokens"]
    result["cached_token_fraction_warm"] = warm_on["num_cached_tokens"] / warm_on["num_prompt_tokens"]
    result["speedup_cache_on_vs_off"] = off["seconds"] / on["seconds"]
    result["speedup_warm_vs_off"] = off["seconds"] / warm_on["seconds"]
    result["speedup_shared_vs_random_prefix"] = result["random_prefix_cache_on"]["seconds"] / on["seconds"]
    return result


def _median(runs: list[RunFigures]) -> dict:
    best = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    return {"seconds": best.seconds, "output_tok_s": best.output_tok_s, "num_output_tokens": best.num_output_tokens,
            "num_prompt_tokens": best.num_prompt_tokens, "num_cached_tokens": best.num_cached_tokens,
            "ttft_p50_s": best.ttft_p50_s, "ttft_p90_s": best.ttft_p90_s,
            "all_seconds": [r.seconds for r in runs]}


def _hardware(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} cpu, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["w0", "w1", "w2"], required=True)
    p.add_argument("--model", default="bundled")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (W2: the question's)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-groups", type=int, default=4, help="W2 groups")
    p.add_argument("--per-group", type=int, default=8, help="W2 requests per group")
    p.add_argument("--prefix-len", type=int, default=512, help="W2 system prompt tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="EngineConfig.kv_cache_dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peer", action="store_true", help="W0/W1: skip transformers generate()")
    p.add_argument("--out", default="bench/results", help="folder for the JSON result")
    args = p.parse_args(argv)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    args.resolved_device, args.torch_dtype = config.resolved_device(), config.resolved_dtype()
    loaded = load_model(args.model, dtype=args.torch_dtype, device=args.resolved_device)
    figures = bench_w2(args, loaded) if args.workload == "w2" else bench_w0(args, loaded)
    record = {"command": "python -m bench.engine_offline " + " ".join(argv or __import__("sys").argv[1:]),
              "commit": _commit(), "hardware": _hardware(args.resolved_device), "date": time.strftime("%Y-%m-%d"),
              "workload": args.workload, "model": args.model, "dtype": str(args.torch_dtype),
              "settings": {k: v for k, v in vars(args).items() if k not in ("torch_dtype",)}, "figures": figures}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_{args.workload}_{args.resolved_device}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    print(json.dumps(figures, indent=2, default=str))
    print(f"wrote {path}")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
