"""`radixserve bench`: arguments, the runs of a sweep (variants × rates), and the outputs of each."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
import urllib.request
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from radixserve.bench import plots, report, runner, scrape, timeline, workloads
from radixserve.bench.client import Target
from radixserve.bench.metrics import summarize, totals

WARMUP_SALT = 1_000_000  # warm-up prompts never share content with measured ones
SIZE_HELP = {
    "num_requests": "requests (W0, W1, W3, W4, custom)",
    "input_len": "prompt tokens; W2: the question's; W3/W6: the mean; W4: the chat prompts'; W5: each user turn's",
    "output_len": "max_tokens (exact with ignore_eos); W3/W6: the mean",
    "num_groups": "W2 system prompts; W6 shared system prompts", "per_group": "W2 requests per system prompt",
    "prefix_len": "W2/W5/W6 system prompt tokens", "long_input_len": "W4 long prompts' tokens",
    "long_output_len": "W4 long requests' max_tokens", "long_fraction": "W4 share of long requests",
    "num_sessions": "W5 sessions", "turns": "W5 turns per session",
}


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    p.add_argument("--workload", default=None,
                   help="w0 hf-parity, w1 decode-heavy, w2 shared-prefix, w3 online, w4 pd-mix, w5 multi-turn, "
                        "w6 sustained, custom")
    p.add_argument("--trace", default=None, help='JSONL: {"timestamp", "prompt_ids"|"prompt"|"messages", "max_tokens"}')
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="bundled|DIR: send text of exact token lengths (default: token-id prompts)")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions with messages (needs --tokenizer)")
    p.add_argument("--vocab-size", type=int, default=32000, help="token-id prompts draw ids below this")
    sizes = p.add_argument_group("workload sizes (defaults per workload: see docs/PERFORMANCE.md)")
    for field in fields(workloads.Settings):
        if field.name in SIZE_HELP:
            kind = float if field.name == "long_fraction" else int
            sizes.add_argument("--" + field.name.replace("_", "-"), type=kind, default=None, help=SIZE_HELP[field.name])
    sizes.add_argument("--variant", default="shared", help="W2: shared, random, or shared,random (both, in order)")
    sizes.add_argument("--sigma", type=float, default=0.8, help="W3 log-normal length shape")
    load = p.add_argument_group("load")
    load.add_argument("--rate", default=None, help="req/s (sessions/s for W5); inf = all at once; "
                                                   "a list 1,2,4 sweeps (default inf; W3/W4: 1)")
    load.add_argument("--arrival", choices=["poisson", "uniform"], default=None,
                      help="gaps between arrivals (default poisson; W4 uniform)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="at most this many requests in flight; W6: exactly this many (default 32)")
    load.add_argument("--duration-s", type=float, default=300.0, help="W6: how long the closed loop sends")
    load.add_argument("--sample-interval-s", type=float, default=10.0,
                      help="W6: seconds between samples of throughput and the server's /metrics")
    load.add_argument("--warmup", type=int, default=0, help="requests sent (and not measured) before each run")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--slo-ttft-ms", type=float, default=None)
    load.add_argument("--slo-tpot-ms", type=float, default=None)
    req = p.add_argument_group("requests")
    req.add_argument("--no-ignore-eos", action="store_true", help="omit ignore_eos (servers that reject it)")
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--api-key", default="")
    req.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    out = p.add_argument_group("output")
    out.add_argument("--out-dir", default="bench/results", help="folder for the JSON result")
    out.add_argument("--plot-dir", default=None, help="folder for the PNG plots (default: --out-dir)")
    out.add_argument("--name", default=None, help="file stem for the JSON and plots")
    out.add_argument("--hardware", default=None, help="describe the server's hardware for the record")
    out.add_argument("--request-detail", choices=["full", "compact", "none"], default="full",
                     help="per-request records in the JSON: all fields, without the ITL lists, or none (long runs)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--compare", nargs="+", metavar="RESULT.json", default=None,
                     help="print these result files' runs side by side with ratios, and plot them together")


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    command = "radixserve bench " + shlex.join(argv if argv is not None else sys.argv[2:])
    if args.compare:
        return _compare(args)
    if not args.workload and not args.trace:
        print("error: give --workload NAME or --trace FILE (or --compare A.json B.json)", file=sys.stderr)
        return 2
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    runner.raise_open_files_limit()
    tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
    if args.chat and tokenizer is None and not args.trace:
        print("error: --chat needs --tokenizer (chat messages are text)", file=sys.stderr)
        return 2
    maker = workloads.TextPrompts(tokenizer) if tokenizer else workloads.IdPrompts(args.vocab_size)
    name = workloads.ALIASES.get(args.workload, args.workload) if args.workload else "trace"
    settings = _settings(args, name)
    rates = [math.inf] if name == "w6" else _rates(args.rate, name)  # W6 is a closed loop: no rate
    arrival = args.arrival or ("uniform" if name == "w4" else "poisson")
    model = args.model or _first_model(base_url, args.api_key)
    target = Target(base_url, model, is_chat=args.chat, ignore_eos=not args.no_ignore_eos,
                    temperature=args.temperature, api_key=args.api_key, timeout_s=args.timeout_s)
    variants = args.variant.split(",") if name == "w2" else [None]
    runs = []
    for variant in variants:
        for rate in rates:
            salt = len(runs)
            run_settings = settings if variant is None else replace(settings, variant=variant)
            if name == "w6":
                run = _sustained_run(args, run_settings, maker, target, salt)
            else:
                run = _one_run(args, name, run_settings, maker, target, rate, arrival, salt, variant)
            repeat = sum(r["label"].split(" #")[0] == run["label"] for r in runs)
            run["label"] += f" #{repeat + 1}" if repeat else ""
            runs.append(run)
    print(report.table(runs, with_ratios=len(runs) > 1))
    stem = args.name or f"{name}{'_' + '-'.join(variants) if variants != [None] else ''}_{time.strftime('%Y%m%d-%H%M%S')}"
    record = report.result_record(
        command, name, {**(asdict(settings) if settings else {}), "rates": rates, "arrival": arrival,
                        "concurrency": args.concurrency, "warmup": args.warmup, "seed": args.seed,
                        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
                        **({"duration_s": args.duration_s, "sample_interval_s": args.sample_interval_s,
                            "concurrency": _w6_concurrency(args)} if name == "w6" else {}),
                        "prompts": "text" if tokenizer else "token ids", "tokenizer": args.tokenizer,
                        "trace": args.trace, "endpoint": target.url.split("/v1/")[1],
                        "ignore_eos": target.ignore_eos, "temperature": target.temperature,
                        "request_detail": args.request_detail},
        {"base_url": base_url, "model": model}, [_detailed(run, args.request_detail) for run in runs], args.hardware)
    path = report.write_json(record, args.out_dir, stem)
    print(f"wrote {path}")
    if not args.no_plots:
        try:
            for plot in _plot(runs, Path(args.plot_dir or args.out_dir), stem, f"{name} · {model} · {stem}"):
                print(f"wrote {plot}")
        except ImportError:
            print("no plots: matplotlib is not installed", file=sys.stderr)
    return 0 if all(r["figures"]["num_ok"] for r in runs) else 1


def _one_run(args, name: str, settings, maker, target: Target, rate: float, arrival: str, salt: int,
             variant: str | None) -> dict[str, Any]:
    label = ", ".join(x for x in (variant, f"rate={rate:g}" if len(_rates(args.rate, name)) > 1 else None) if x) \
        or f"rate={rate:g}"
    work = _workload(args, name, settings, maker, salt)
    if args.warmup:
        warm = runner.warmup_workload(_workload(args, name, settings, maker, WARMUP_SALT + salt), args.warmup)
        asyncio.run(runner.run(warm, target, [0.0] * (len(warm.sessions) or len(warm.requests)), maker,
                               args.concurrency, f"warm-up {label}", not args.no_progress))
    num_arrivals = len(work.sessions) or len(work.requests)
    if work.requests and work.requests[0].arrival_s is not None:
        arrivals = [r.arrival_s or 0.0 for r in work.requests]
    else:
        arrivals = workloads.arrival_times(num_arrivals, rate, args.seed + salt, arrival)
    before = asyncio.run(scrape.fetch_cache_counts(target.base_url, target.headers))
    records, duration_s = asyncio.run(runner.run(work, target, arrivals, maker, args.concurrency, label,
                                                 not args.no_progress))
    figures = summarize(records, duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
    if figures["cache_hit_rate"] is None:
        after = asyncio.run(scrape.fetch_cache_counts(target.base_url, target.headers))
        rate_from_metrics = scrape.hit_rate_between(before, after)
        if rate_from_metrics is not None:
            figures["cache_hit_rate"], figures["cache_hit_rate_source"] = rate_from_metrics, "/metrics"
    return {"label": label, "series": variant or "", "rate": rate, "variant": variant, "figures": figures,
            "totals": totals(records, target.ignore_eos), "requests": [r.to_json() for r in records]}


def _detailed(run: dict[str, Any], detail: str) -> dict[str, Any]:
    """run as the JSON keeps it: every request's record, those without their ITL lists, or none."""
    if detail == "full":
        return run
    requests = [] if detail == "none" else [{k: v for k, v in r.items() if k != "itl_s"} for r in run["requests"]]
    return {**run, "requests": requests}


def _w6_concurrency(args: argparse.Namespace) -> int:
    return args.concurrency or 32


def _sustained_run(args, settings, maker, target: Target, salt: int) -> dict[str, Any]:
    """W6: the closed loop, its window rows (`samples`), the loop's own throughput and the steady ratio."""
    concurrency = _w6_concurrency(args)
    source = workloads.Sustained(settings, maker, args.seed, salt, is_chat=args.chat)
    records, duration_s, samples = asyncio.run(runner.run_closed_loop(
        source.request, target, concurrency, args.duration_s, args.sample_interval_s, not args.no_progress))
    loop_s = samples[-1]["t_end_s"] if samples else args.duration_s
    sustained = {"concurrency": concurrency, "duration_s": args.duration_s, "sample_interval_s": args.sample_interval_s,
                 "output_tok_s": sum(w["num_output_tokens"] for w in samples) / loop_s if loop_s > 0 else None,
                 "drain_s": max(0.0, duration_s - loop_s),
                 **timeline.steady(samples, args.duration_s, args.sample_interval_s)}
    return {"label": f"concurrency={concurrency}", "series": "", "rate": None, "variant": None,
            "figures": summarize(records, duration_s, args.slo_ttft_ms, args.slo_tpot_ms),
            "totals": totals(records, target.ignore_eos), "sustained": sustained, "samples": samples,
            "requests": [r.to_json() for r in records]}


def _workload(args, name: str, settings, maker, salt: int) -> workloads.Workload:
    if args.trace:
        return workloads.load_trace(args.trace, maker)
    return workloads.build(name, settings, maker, args.seed, salt, is_chat=args.chat)


def _settings(args: argparse.Namespace, name: str) -> workloads.Settings | None:
    if name == "trace":
        return None
    given = {f.name: getattr(args, f.name) for f in fields(workloads.Settings) if f.name != "variant"}
    return workloads.resolve(name, workloads.Settings(**given, variant=args.variant.split(",")[0]))


def _rates(text: str | None, name: str) -> list[float]:
    if text is None:
        return [1.0] if name in ("w3", "w4") else [math.inf]
    return [float(x) for x in text.split(",") if x.strip()]


def _first_model(base_url: str, api_key: str) -> str:
    request = urllib.request.Request(f"{base_url}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _tokenizer(spec: str):
    from services.tokenizer.model_files import load_tokenizer
    return load_tokenizer(spec)


def _plot(runs: list[dict[str, Any]], plot_dir: Path, stem: str, title: str) -> list[Path]:
    paths = []
    if any(r.get("requests") for r in runs):  # result files written with --request-detail none have none
        paths.append(plots.latency_cdfs(runs, plot_dir / f"{stem}_cdf.png", title))
    if any(r.get("samples") for r in runs):
        paths.append(plots.timeline(runs, plot_dir / f"{stem}_timeline.png", title))
    if sum(1 for r in runs if math.isfinite(r.get("rate") or math.inf)) > 1:
        paths.append(plots.ttft_vs_rate(runs, plot_dir / f"{stem}_ttft_vs_rate.png", title))
    return paths


def _compare(args: argparse.Namespace) -> int:
    runs = report.load_runs(args.compare)
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        runs = [report.with_slo(run, args.slo_ttft_ms, args.slo_tpot_ms) for run in runs]
    print(report.table(runs, with_ratios=True))
    if len(runs) > 1:
        print(report.answer(runs))
    if not args.no_plots:
        stem = args.name or "compare_" + "_vs_".join(Path(p).stem for p in args.compare)[:150]
        for run in runs:
            run["series"] = Path(run["source"]).stem
        for plot in _plot(runs, Path(args.plot_dir or args.out_dir), stem, "compare: " + " vs ".join(args.compare)):
            print(f"wrote {plot}")
    return 0
