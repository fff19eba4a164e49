"""Soak: sustained load above capacity on `radixserve serve` (random:tiny-llama on the CPU, loopback only).

Run by hand, not in CI:  .venv/bin/python -m tests.reliability.soak --duration 180

More clients than the gateway admits (--clients > --max-concurrent) send token-id prompts (sharing prefixes),
a third of them streamed and some dropped mid-stream. The RSS of every child is sampled; at the end the script
checks that every answer was 200/429/503/504, every whole (not streamed) answer has exactly its max_tokens tokens
(ignore_eos), nothing is left in flight, the engines hold no request's KV page and run no sequence, and no child's
memory grew past the bound after warm-up. It prints the figures (and writes them as JSON with --out); exit status 1
on a violation. --serve-args adds serve flags, e.g. speculation under the same load:

    .venv/bin/python -m tests.reliability.soak --duration 180 --serve-args "--speculative-method ngram"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

from tests.e2e.conftest import series_sum
from tests.reliability.cluster import MODEL, free_port, http_status, scheduler_status, wait_until

CLEAN_STATUSES = {200, 429, 503, 504}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=96, help="concurrent clients")
    parser.add_argument("--max-concurrent", type=int, default=32, help="the gateway's max_concurrent_requests")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the memory baseline")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0, help="allowed growth after warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="", help="more `radixserve serve` flags, as one string")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    return parser.parse_args(argv)


def start_serve(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "RADIXSERVE_MAX_CONCURRENT_REQUESTS": str(args.max_concurrent),
           "RADIXSERVE_REQUEST_TIMEOUT_S": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model", MODEL, "--device", "cpu",
                             "--port", str(port), "--num-pages", "512", "--workers", str(args.workers),
                             *shlex.split(args.serve_args)],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: proc.poll() is not None or http_status(url + "/health") == 200, 120, 0.2)
    if proc.poll() is not None:
        raise SystemExit(f"serve exited with {proc.returncode}; see {log_path}")
    return proc, url


def children(proc: subprocess.Popen) -> dict[str, psutil.Process]:
    """Each child by its service name (worker0, tokenizer0, ...)."""
    named = {}
    for child in psutil.Process(proc.pid).children():
        argv = child.cmdline()
        module = next((a for a in argv if a.startswith("services.")), "?").removeprefix("services.")
        name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else module
        named[name] = child
    return named


async def sample_rss(procs: dict[str, psutil.Process], samples: list[tuple[float, dict[str, float]]],
                     started: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - started,
                        {name: p.memory_info().rss / 2**20 for name, p in procs.items() if p.is_running()}))
        try:
            await asyncio.wait_for(stop.wait(), 5.0)
        except TimeoutError:
            pass


def make_body(rng: random.Random) -> tuple[dict, bool, bool]:
    """(body, is_stream, drops_mid_stream): shared 32-token prefixes, then a random tail."""
    prefix = [(rng.randrange(8) * 97 + i) % 500 + 4 for i in range(32)]
    tail = [rng.randrange(4, 500) for _ in range(rng.randint(1, 160))]
    is_stream = rng.random() < 0.33
    body = {"model": MODEL, "prompt": prefix + tail, "max_tokens": rng.randint(1, 128), "temperature": 0.8,
            "ignore_eos": True, "stream": is_stream}
    return body, is_stream, is_stream and rng.random() < 0.15


async def client(session: aiohttp.ClientSession, url: str, rng: random.Random, deadline: float,
                 stats: Counter, latencies: list[float]) -> None:
    while time.monotonic() < deadline:
        body, is_stream, drops = make_body(rng)
        started = time.monotonic()
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status == 200 and is_stream:
                    num_events = 0
                    async for line in resp.content:
                        num_events += line.startswith(b"data: ")
                        if drops and num_events == 3:
                            stats["dropped_mid_stream"] += 1
                            break
                    else:
                        stats["streams_finished"] += 1
                elif resp.status == 200:
                    answer = await resp.json()
                    if answer["usage"]["completion_tokens"] != body["max_tokens"]:
                        stats["wrong_length"] += 1
                else:
                    await resp.read()
                stats[resp.status] += 1
                if resp.status == 200:
                    latencies.append(time.monotonic() - started)
                elif resp.status == 429:
                    await asyncio.sleep(float(resp.headers.get("Retry-After", "1")) * rng.random())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            stats[f"client_error:{type(exc).__name__}"] += 1


async def run_load(args: argparse.Namespace, url: str, procs: dict[str, psutil.Process]) -> dict:
    rng = random.Random(args.seed)
    stats: Counter = Counter()
    latencies: list[float] = []
    samples: list[tuple[float, dict[str, float]]] = []
    started = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_rss(procs, samples, started, stop))
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, url, random.Random(rng.random()), started + args.duration, stats,
                                      latencies) for _ in range(args.clients)))
    stop.set()
    await sampler
    return {"stats": stats, "latencies": latencies, "samples": samples, "elapsed_s": time.monotonic() - started}


def summarize(args: argparse.Namespace, load: dict, after: dict) -> dict:
    stats, samples = load["stats"], load["samples"]
    baseline = next((s for t, s in samples if t >= args.warmup), samples[0][1])
    last = samples[-1][1]
    rss = {name: {"start_mb": round(samples[0][1][name], 1), "after_warmup_mb": round(baseline[name], 1),
                  "end_mb": round(last.get(name, 0.0), 1),
                  "max_mb": round(max(s.get(name, 0.0) for _, s in samples), 1),
                  "growth_after_warmup_mb": round(last.get(name, 0.0) - baseline[name], 1)}
           for name in baseline}
    lat = sorted(load["latencies"])
    statuses = {str(k): v for k, v in stats.items() if isinstance(k, int)}
    return {
        "duration_s": round(load["elapsed_s"], 1), "clients": args.clients, "max_concurrent": args.max_concurrent,
        "workers": args.workers, "num_requests": sum(statuses.values()), "statuses": statuses,
        "other": {k: v for k, v in stats.items() if not isinstance(k, int)},
        "ok_per_s": round(stats[200] / load["elapsed_s"], 1),
        "latency_ok_s": {"p50": round(lat[len(lat) // 2], 3), "p99": round(lat[int(len(lat) * 0.99)], 3)} if lat else {},
        "rss": rss, "after": after,
    }


def violations(args: argparse.Namespace, figures: dict) -> list[str]:
    found = [f"unclean status {s}: {n}" for s, n in figures["statuses"].items() if int(s) not in CLEAN_STATUSES]
    found += [f"{k}: {v}" for k, v in figures["other"].items() if k.startswith("client_error") or k == "wrong_length"]
    found += [f"{name} grew {r['growth_after_warmup_mb']} MB" for name, r in figures["rss"].items()
              if r["growth_after_warmup_mb"] > args.max_rss_growth_mb]
    after = figures["after"]
    if after["scheduler_in_flight"] != 0 or after["scheduler_queued"] != 0 or after["gateway_in_flight"] != 0:
        found.append(f"left in flight: {after}")
    if after["engine_running"] != 0 or after["engine_request_pages_perc"] != 0:
        found.append(f"engines not idle: {after}")
    if not after["all_alive"]:
        found.append("a child died")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_path = Path(f"/tmp/radixserve-soak-{os.getpid()}.log")
    proc, url = start_serve(args, log_path)
    try:
        procs = children(proc)
        load = asyncio.run(run_load(args, url, procs))
        sched = next(a for p in procs.values() for a in p.cmdline() if a.endswith("/scheduler"))
        status = wait_until(lambda: (s := scheduler_status(sched)) and s.num_in_flight == 0 and s, 15)
        try:
            metrics = wait_until(lambda: (text := aiohttp_free_get(url + "/metrics")) and engines_idle(text) and text,
                                 20, 0.5)
        except TimeoutError:  # reported below, from the last scrape
            metrics = aiohttp_free_get(url + "/metrics")
        gateway_in_flight = float(next(line.split()[1] for line in metrics.splitlines()
                                       if line.startswith("radixserve_gateway_requests_in_flight ")))
        after = {"scheduler_in_flight": status.num_in_flight, "scheduler_queued": status.num_queued,
                 "gateway_in_flight": gateway_in_flight,
                 "engine_running": series_sum(metrics, "radixserve_num_requests_running"),
                 "engine_request_pages_perc": series_sum(metrics, "radixserve_kv_cache_usage_perc"),
                 "engine_steps": series_sum(metrics, "radixserve_engine_step_seconds_count"),
                 "generation_tokens": series_sum(metrics, "radixserve_generation_tokens_total"),
                 **{name: series_sum(metrics, f"radixserve_spec_decode_num_{name}_total")
                    for name in ("drafts", "draft_tokens", "accepted_tokens")},
                 "all_alive": all(p.is_running() for p in procs.values())}
        figures = summarize(args, load, after)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    figures["serve_exit_code"] = proc.returncode
    print(json.dumps(figures, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    problems = violations(args, figures) + ([] if proc.returncode == 0 else ["serve did not exit cleanly"])
    for problem in problems:
        print("VIOLATION:", problem, file=sys.stderr)
    print(f"serve log: {log_path}", file=sys.stderr)
    return 1 if problems else 0


def engines_idle(text: str) -> bool:
    """No engine runs a sequence or holds a request's KV page (the workers report every second or so)."""
    return (series_sum(text, "radixserve_num_requests_running") == 0
            and series_sum(text, "radixserve_kv_cache_usage_perc") == 0)


def aiohttp_free_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


if __name__ == "__main__":
    sys.exit(main())
