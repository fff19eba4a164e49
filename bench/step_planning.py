"""CPU micro-benchmark of the worker's step planning (BatchPolicy + RadixCache + BlockPool, no model).

Runs decode steps of `--num-running` sequences against a pool that is full: the prefix cache holds
`--num-cached-tokens` evictable tokens and every page a growing sequence needs must come from eviction.
The same steps against an empty cache (free pages, nothing to evict) are the baseline; the ratio
full / empty is the cost that a full cache adds to each step.

    python -m bench.step_planning --num-cached-tokens 1000000 --num-running 512 --out bench/results/x.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from dataclasses import dataclass

from services.gpu_worker.batch_policy import BatchPolicy
from services.gpu_worker.block_pool import BlockPool
from services.gpu_worker.radix_cache import RadixCache
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.sequence import Sequence

PAGE_SIZE = 16
VOCAB = 32000
MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class Setup:
    num_cached_tokens: int
    num_running: int
    prompt_len: int
    num_steps: int
    cached_prompt_len: int = 1024


def random_tokens(rng: random.Random, num: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(num)]


def fill_cache(pool: BlockPool, cache: RadixCache, setup: Setup, rng: random.Random) -> None:
    """Cache num_cached_tokens of unrelated finished requests, held by the tree alone (all evictable).

    Each is cached as the engine caches it: its prompt (the first half) in one insert, then its output
    one page at a time as decoding filled them, which leaves a chain of one-page nodes per request.
    """
    num_requests = setup.num_cached_tokens // setup.cached_prompt_len
    num_pages = setup.cached_prompt_len // PAGE_SIZE
    for i in range(num_requests):
        token_ids, page_ids = random_tokens(rng, setup.cached_prompt_len), pool.allocate(num_pages)
        for num_done in range(num_pages // 2, num_pages + 1):
            cache.insert(token_ids[:num_done * PAGE_SIZE], page_ids[:num_done], now=float(i))
        pool.free(page_ids)
    cache.drain_events()


def make_policy(setup: Setup, is_full: bool) -> BatchPolicy:
    """A pool sized so that, when is_full, the running prompts fit only beside the cached pages."""
    num_running_pages = setup.num_running * -(-setup.prompt_len // PAGE_SIZE)
    num_cached_pages = setup.num_cached_tokens // PAGE_SIZE if is_full else 0
    num_prefill_steps = -(-setup.num_running * setup.prompt_len // MAX_NUM_BATCHED_TOKENS)  # early ones decode
    num_decode_pages = setup.num_running * (-(-(setup.num_steps + num_prefill_steps) // PAGE_SIZE) + 1)
    num_pages = 1 + num_cached_pages + num_running_pages + (0 if is_full else num_decode_pages)
    pool = BlockPool(num_pages)
    cache = RadixCache(pool, PAGE_SIZE, "bench")
    if is_full:
        fill_cache(pool, cache, setup, random.Random(1))
    return BatchPolicy(pool, cache, PAGE_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=setup.num_running)


def run_steps(policy: BatchPolicy, setup: Setup, rng: random.Random) -> list[float]:
    """Prefill every sequence, then time num_steps decode steps (plan + bookkeeping, one token each)."""
    params = SamplingParams(max_tokens=setup.num_steps + 10, ignore_eos=True)
    for i in range(setup.num_running):
        policy.add(Sequence(i, f"r{i}", 0, random_tokens(rng, setup.prompt_len), setup.prompt_len, params, 0.0))
    now, times = 1e6, []
    while True:
        now += 1.0
        started = time.perf_counter()
        plan = policy.schedule(now)
        is_decode = all(item.num_new_tokens == 1 for item in plan.items) and not policy.waiting
        for item in plan.items:
            if item.is_sampling:
                item.seq.token_ids.append(rng.randrange(VOCAB))
        for seq in policy.advance(plan):
            policy.cache_computed(seq, now)
        if is_decode:
            times.append(time.perf_counter() - started)
            if len(times) == setup.num_steps:
                return times
        if plan.preempted:
            raise RuntimeError("the benchmark's pool is too small: a sequence was preempted")


def measure(setup: Setup, is_full: bool) -> dict:
    policy = make_policy(setup, is_full)
    num_cached_before = policy.cache.num_cached_pages
    times = run_steps(policy, setup, random.Random(2))
    return {"num_cached_pages_at_start": num_cached_before, "num_steps": len(times),
            "step_ms_median": statistics.median(times) * 1e3, "step_ms_mean": statistics.fmean(times) * 1e3,
            "step_ms_max": max(times) * 1e3, "num_cached_pages_at_end": policy.cache.num_cached_pages,
            "num_free_pages_at_end": policy.pool.num_free}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-cached-tokens", type=int, default=1_000_000)
    parser.add_argument("--num-running", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--num-steps", type=int, default=64)
    parser.add_argument("--out", default="", help="write the JSON result here")
    args = parser.parse_args()
    setup = Setup(args.num_cached_tokens, args.num_running, args.prompt_len, args.num_steps)
    empty = measure(setup, is_full=False)
    full = measure(setup, is_full=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "step_planning", "command": "python -m bench.step_planning " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "commit": commit, "hardware": platform.processor() or platform.machine(),
              "python": platform.python_version(), "setup": vars(args), "empty_cache": empty, "full_cache": full,
              "full_over_empty_median": full["step_ms_median"] / empty["step_ms_median"]}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
