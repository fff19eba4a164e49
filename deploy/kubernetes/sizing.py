"""Measure what one replica of each service costs per request: the rehearsal's pods (rehearse.py) under a load of short
streaming chat completions, and each container's CPU seconds over it (its process tree, from /proc via psutil).

    python deploy/kubernetes/sizing.py [--overlay cpu] [--requests 400] [--concurrency 16] [--max-tokens 16]

requests/s per core = requests / CPU seconds: what one replica does with one core to itself, the figure that sizes
CPU requests and the CPU autoscaler's target. The wall-clock rate is printed too, but on a machine whose cores
every process shares it says more about the machine than about any one service.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rehearse  # noqa: E402
import render  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """CPU time of pid and its children (a worker's tensor-parallel ranks, say) so far."""
    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        times = p.cpu_times()
        total += times.user + times.system
    return total


def chat(base_url: str, model: str, i: int, max_tokens: int) -> rehearse.Outcome:
    return rehearse.stream(base_url, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": f"Name a colour ({i})."}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True})


def measure(overlay: str, work_dir: Path, num_requests: int, concurrency: int, max_tokens: int) -> dict:
    cluster = rehearse.Cluster(render.render(rehearse.HERE / "overlays" / overlay), work_dir)
    for pod in cluster.pods:
        cluster.start(pod)
    try:
        cluster.wait_ready(list(cluster.pods))
        gateways = [f"http://{p.ip}:8000" for p in cluster.by_component("frontend")]
        model = rehearse.model_id(gateways[0])
        for i in range(8):  # warm-up: first requests pay one-time costs (templates, imports, JIT)
            chat(gateways[i % len(gateways)], model, i, max_tokens)
        processes = {(pod.name, name): process.pid for pod in cluster.pods
                     for name, process in pod.processes.items()}
        before = {key: cpu_seconds(pid) for key, pid in processes.items()}
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda i: chat(gateways[i % len(gateways)], model, i, max_tokens),
                                     range(num_requests)))
        wall_s = time.monotonic() - started
        used: dict[str, float] = {}
        for key, pid in processes.items():
            used[key[1]] = used.get(key[1], 0.0) + cpu_seconds(pid) - before[key]
    finally:
        cluster.stop_all()
    num_ok = sum(o.is_complete for o in outcomes)
    replicas = {name: sum(1 for k in processes if k[1] == name) for name in used}
    return {"overlay": overlay, "num_requests": num_requests, "num_complete": num_ok, "concurrency": concurrency,
            "max_tokens": max_tokens, "wall_s": round(wall_s, 1), "requests_per_s": round(num_ok / wall_s, 1),
            "replicas": replicas,
            "cpu_ms_per_request": {n: round(1000 * s / num_ok, 2) for n, s in sorted(used.items())},
            "requests_per_s_per_core": {n: round(num_ok / s, 1) for n, s in sorted(used.items()) if s > 0}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overlay", default="cpu")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    report = measure(args.overlay, Path(tempfile.mkdtemp(prefix="sizing-")), args.requests, args.concurrency,
                     args.max_tokens)
    print(json.dumps(report, indent=2))
    return 0 if report["num_complete"] == report["num_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
