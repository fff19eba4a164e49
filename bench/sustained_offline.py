"""Offline W6 (no HTTP): the engine alone in a closed loop at a fixed concurrency, W6's requests (half on 32 shared
system prompts, chat-like lengths), with where each step's time goes. The served W6 (`radixserve bench --workload
w6`) is the headline; this is its ceiling, and the place to A/B a scheduling lever on one warm engine.

Each variant runs on the same engine in turn (the prefix cache stays full between them): a warm-in, then a timed
window. Per step it records whether the step replayed a CUDA graph (decodes alone) or ran eager (a prompt chunk in
it), its wall time, the host's time to queue the forward, and the time the host waited for the GPU (overlap mode
reads step N's tokens after queueing step N+1: a host that never waits is the bottleneck).

    python -m bench.sustained_offline --model random:llama3-8b --device cuda --concurrency 512 \\
        --variants 1:0,16:8 --warmin-s 15 --duration-s 45 --out bench/results/x.json

A variant `K:D` sets BatchPolicy.min_admit_batch K and max_admit_delay_steps D (1:0 admits every step).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

from radixserve.bench.workloads import IdPrompts, Settings, Sustained, resolve
from services.gpu_worker import sampler as sampler_module
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.request import SamplingParams


@dataclass
class StepLog:
    """Sums over the steps of one kind (graph: decodes alone; eager: a prompt chunk in the step)."""

    num_steps: int = 0
    wall_s: float = 0.0
    forward_host_s: float = 0.0
    gpu_wait_s: float = 0.0
    num_tokens: int = 0
    walls: list[float] = field(default_factory=list)

    def figures(self) -> dict:
        n = max(self.num_steps, 1)
        return {"num_steps": self.num_steps, "mean_wall_ms": 1e3 * self.wall_s / n,
                "median_wall_ms": 1e3 * statistics.median(self.walls) if self.walls else None,
                "mean_forward_host_ms": 1e3 * self.forward_host_s / n, "mean_gpu_wait_ms": 1e3 * self.gpu_wait_s / n,
                "mean_tokens": self.num_tokens / n, "share_of_wall": None}


class Probe:
    """Timers patched around the engine: the forward's host time and the wait in SampledBatch.resolve."""

    def __init__(self, engine: Engine) -> None:
        self.forward_s = 0.0
        self.wait_s = 0.0
        self.last_plan_tokens = 0
        original_schedule = engine.policy.schedule

        def recorded_schedule(now):
            plan = original_schedule(now)
            self.last_plan_tokens = plan.num_tokens
            return plan

        engine.policy.schedule = recorded_schedule
        original_forward = engine._forward

        def timed_forward(plan):
            start = time.perf_counter()
            result = original_forward(plan)
            self.forward_s += time.perf_counter() - start
            return result

        engine._forward = timed_forward
        original_resolve = sampler_module.SampledBatch.resolve
        probe = self

        def timed_resolve(batch):
            if batch._resolved is None and batch._event is not None:
                start = time.perf_counter()
                batch._event.synchronize()
                probe.wait_s += time.perf_counter() - start
            return original_resolve(batch)

        sampler_module.SampledBatch.resolve = timed_resolve


class ClosedLoop:
    """Keeps `concurrency` requests in the engine: each finished one is replaced by the source's next."""

    def __init__(self, engine: Engine, source: Sustained, concurrency: int) -> None:
        self.engine, self.source, self.concurrency = engine, source, concurrency
        self.next_index = 0
        self.added_at: dict[str, float] = {}
        self.expected: dict[str, int] = {}
        self.got: dict[str, int] = {}
        self.ttfts: list[float] = []
        self.num_short = 0

    def top_up(self) -> None:
        while len(self.added_at) < self.concurrency:
            spec = self.source.request(self.next_index)
            rid = f"s{self.next_index}"
            self.next_index += 1
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            self.engine.add_request(rid, spec.prompt, params)
            self.added_at[rid], self.expected[rid], self.got[rid] = time.perf_counter(), spec.max_tokens, 0

    def take(self, outputs, is_timed: bool) -> tuple[int, int, int]:
        """→ (output tokens, prompt tokens of finished requests, their cached tokens)."""
        num_out = num_prompt = num_cached = 0
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if self.got[rid] == 0 and is_timed:
                self.ttfts.append(now - self.added_at[rid])
            self.got[rid] += len(out.token_ids)
            num_out += len(out.token_ids)
            if out.finish_reason is not None:
                if self.got[rid] != self.expected[rid]:
                    self.num_short += 1
                num_prompt += out.num_prompt_tokens
                num_cached += out.num_cached_tokens
                self.engine.release_finished(rid)
                del self.added_at[rid], self.expected[rid], self.got[rid]
        return num_out, num_prompt, num_cached


def run_variant(engine: Engine, probe: Probe, loop: ClosedLoop, min_admit_batch: int, max_delay: int,
                warmin_s: float, duration_s: float) -> dict:
    policy = engine.policy
    policy.min_admit_batch, policy.max_admit_delay_steps = min_admit_batch, max_delay
    logs = {"graph": StepLog(), "eager": StepLog()}
    totals = dict(output_tokens=0, prompt_tokens=0, cached_tokens=0, finished=0)
    start = time.perf_counter()
    timed_from = start + warmin_s
    loop.ttfts.clear()
    preemptions_before = policy.num_preemptions
    while True:
        now = time.perf_counter()
        if now >= timed_from + duration_s:
            break
        is_timed = now >= timed_from
        if is_timed and totals.get("t0") is None:
            totals["t0"] = now
            preemptions_before = policy.num_preemptions
        loop.top_up()
        replays = engine.graphs.num_replays if engine.graphs is not None else 0
        fwd0, wait0 = probe.forward_s, probe.wait_s
        outputs = engine.step()
        wall = time.perf_counter() - now
        if not is_timed:
            loop.take(outputs, False)
            continue
        is_graph = engine.graphs is not None and engine.graphs.num_replays > replays
        log = logs["graph" if is_graph else "eager"]
        log.num_steps += 1
        log.wall_s += wall
        log.walls.append(wall)
        log.forward_host_s += probe.forward_s - fwd0
        log.gpu_wait_s += probe.wait_s - wait0
        log.num_tokens += probe.last_plan_tokens
        num_out, num_prompt, num_cached = loop.take(outputs, True)
        totals["output_tokens"] += num_out
        totals["prompt_tokens"] += num_prompt
        totals["cached_tokens"] += num_cached
        totals["finished"] += sum(1 for o in outputs if o.finish_reason is not None)
    seconds = time.perf_counter() - totals.pop("t0")
    wall_total = sum(log.wall_s for log in logs.values())
    kinds = {}
    for kind, log in logs.items():
        fig = log.figures()
        fig["share_of_wall"] = log.wall_s / wall_total if wall_total else None
        kinds[kind] = fig
    ttfts = sorted(loop.ttfts)
    return {
        "min_admit_batch": min_admit_batch, "max_admit_delay_steps": max_delay, "seconds": seconds,
        "output_tok_s": totals["output_tokens"] / seconds, "finished_requests": totals["finished"],
        "request_s": totals["finished"] / seconds,
        "prefix_hit_rate": totals["cached_tokens"] / max(totals["prompt_tokens"], 1),
        "gpu_wait_share": sum(log.gpu_wait_s for log in logs.values()) / wall_total if wall_total else None,
        "preemptions": policy.num_preemptions - preemptions_before,
        "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "num_short_requests": loop.num_short, "steps": kinds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--variants", default="1:0,16:8", help="comma-separated min_admit_batch:max_admit_delay_steps")
    parser.add_argument("--warmin-s", type=float, default=15.0)
    parser.add_argument("--duration-s", type=float, default=45.0)
    parser.add_argument("--rounds", type=int, default=1, help="run the variant list this many times in turn")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None, help="cap the pool (CPU runs)")
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--prefix-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    config = EngineConfig(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages)
    built = time.perf_counter()
    engine = Engine(config)
    build_s = time.perf_counter() - built
    settings = resolve("w6", Settings(input_len=args.input_len, output_len=args.output_len,
                                      prefix_len=args.prefix_len))
    source = Sustained(settings, IdPrompts(engine.model_config.vocab_size), seed=args.seed)
    probe = Probe(engine)
    loop = ClosedLoop(engine, source, args.concurrency)
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
    runs = []
    for round_index in range(args.rounds):
        for k, d in variants:
            result = run_variant(engine, probe, loop, k, d, args.warmin_s, args.duration_s)
            result["round"] = round_index
            runs.append(result)
            print(json.dumps({key: result[key] for key in ("min_admit_batch", "max_admit_delay_steps", "output_tok_s",
                                                          "gpu_wait_share", "ttft_p50_ms", "prefix_hit_rate")}),
                  flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {
        "command": "python -m bench.sustained_offline " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hardware": torch.cuda.get_device_name() if engine.device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "engine_build_s": build_s,
        "batching": {"max_num_batched_tokens": engine.policy.max_num_batched_tokens,
                     "max_num_seqs": engine.policy.max_num_seqs, "reason": engine.batching.reason},
        "num_pages": engine.num_pages, "concurrency": args.concurrency, "settings": vars(settings), "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
