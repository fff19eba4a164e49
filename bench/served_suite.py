"""The served benchmark suite: `radixserve serve` (its defaults unless --serve-args adds to them) as a subprocess,
driven over HTTP by `radixserve bench`'s streaming client phase by phase; one JSON per phase and a summary.

    python -m bench.served_suite --serve-args "--model random:llama3-8b --device cuda" \\
        --phases w1,w1-nocache,w0,w6 --w6-duration-s 600 --w6-concurrency 512 --out-dir $OUT
    python -m bench.served_suite --scale 0.01 --w1-input-len 100 --w1-output-len 100 --phases w1,w6 \\
        --w6-duration-s 60 --w6-concurrency 8        # CPU, bundled model, scaled down

Phases share a server where their serve arguments agree: w1, w0, w6 and b1 (W0's requests one at a time: the
batch-1 TPOT) one; w1-nocache and w6-nocache (--no-prefix-cache added) another; w0-fp8, b1-fp8, w1-fp8 (with
--quantization fp8) a third; b1-awq and w0-awq (--quantization awq) a fourth. Each phase's JSON is the one
`radixserve bench` writes (its command reproduces the phase against any server), plus the serve command it ran
against.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from radixserve.bench import report, runner
from radixserve.bench.main import run_bench
from radixserve.cli import build_parser

# A phase is WORKLOAD or WORKLOAD-GROUP: the workload sent (b1: W0's shape one request at a time, the batch-1
# TPOT) to the server of that group (its serve arguments added to --serve-args). A phase of another group sends
# the same requests as its default twin, so the two compare request for request.
WORKLOAD_SEEDS = {"w1": 0, "w0": 1, "w6": 2, "b1": 3}
GROUP_SERVE_ARGS = {"default": [], "nocache": ["--no-prefix-cache"], "fp8": ["--quantization", "fp8"],
                    "awq": ["--quantization", "awq"]}
# phase → (server group, workload, seed offset)
PHASES: dict[str, tuple[str, str, int]] = {
    (w if g == "default" else f"{w}-{g}"): (g, w, seed) for g in GROUP_SERVE_ARGS for w, seed in WORKLOAD_SEEDS.items()}
DEFAULT_VOCAB_SIZE = 32000  # below every vocabulary we serve (the bundled model's is 49,152)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.served_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-args", default="", help="extra `radixserve serve` arguments (default none: the product)")
    p.add_argument("--phases", default="w1,w1-nocache,w0,w6,w6-nocache",
                   help=f"of {', '.join(PHASES)} (WORKLOAD-GROUP: that group's serve arguments added)")
    p.add_argument("--out-dir", default=None, help="default bench/results/served_<date-time>")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies W1's and W0's request counts")
    p.add_argument("--w1-requests", type=int, default=1000)
    p.add_argument("--w1-input-len", type=int, default=1000)
    p.add_argument("--w1-output-len", type=int, default=1000)
    p.add_argument("--w0-requests", type=int, default=128)
    p.add_argument("--w0-input-len", type=int, default=512)
    p.add_argument("--w0-output-len", type=int, default=256)
    p.add_argument("--b1-requests", type=int, default=4, help="b1: W0-shaped requests sent one after another")
    p.add_argument("--w6-duration-s", type=float, default=300.0)
    p.add_argument("--w6-concurrency", type=int, default=32)
    p.add_argument("--w6-sample-interval-s", type=float, default=10.0)
    p.add_argument("--w6-prefix-len", type=int, default=1024, help="tokens of each shared system prompt")
    p.add_argument("--w6-num-prefixes", type=int, default=32)
    p.add_argument("--w6-input-len", type=int, default=250, help="mean prompt (question) tokens")
    p.add_argument("--w6-output-len", type=int, default=200, help="mean max_tokens")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: the random:<preset>'s vocabulary, else 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    p.add_argument("--port", type=int, default=0, help="serve's port (0: a free one)")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--stop-timeout-s", type=float, default=60.0, help="after SIGINT, before SIGTERM (then KILL)")
    args = p.parse_args(argv)
    args.phase_list = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = [x for x in args.phase_list if x not in PHASES]
    if unknown:
        p.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    return args


def vocab_size(serve_args: list[str], given: int | None) -> int:
    """Token ids must stay inside the served model's vocabulary: a random:<preset>'s own, else the default."""
    if given is not None:
        return given
    from radixserve.serve import add_serve_arguments
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    model = parser.parse_known_args(serve_args)[0].model
    if model.startswith("random:"):
        from services.gpu_worker.model.presets import preset
        return preset(model.removeprefix("random:")).vocab_size
    return DEFAULT_VOCAB_SIZE


def bench_argv(phase: str, args: argparse.Namespace, url: str, vocab: int, out_dir: Path) -> list[str]:
    """The `radixserve bench` command line of one phase."""
    _, workload, seed_offset = PHASES[phase]
    argv = ["bench", "--base-url", url, "--workload", workload, "--vocab-size", str(vocab),
            "--seed", str(args.seed + seed_offset), "--timeout-s", f"{args.request_timeout_s:g}",
            "--out-dir", str(out_dir), "--name", phase,
            "--request-detail", "none" if workload == "w6" else "compact"]  # NOTE: W1's full ITLs: ~20 MB
    if workload == "w6":
        return argv + ["--duration-s", f"{args.w6_duration_s:g}", "--concurrency", str(args.w6_concurrency),
                       "--sample-interval-s", f"{args.w6_sample_interval_s:g}",
                       "--prefix-len", str(args.w6_prefix_len), "--num-groups", str(args.w6_num_prefixes),
                       "--input-len", str(args.w6_input_len), "--output-len", str(args.w6_output_len)]
    if workload == "b1":  # W0's requests, one in flight at a time
        argv[argv.index("--workload") + 1] = "w0"
        return argv + ["--rate", "inf", "--concurrency", "1", "--num-requests", str(args.b1_requests),
                       "--input-len", str(args.w0_input_len), "--output-len", str(args.w0_output_len), "--no-progress"]
    num, input_len, output_len = (getattr(args, f"{workload}_{k}") for k in ("requests", "input_len", "output_len"))
    return argv + ["--rate", "inf", "--num-requests", str(max(1, round(num * args.scale))),
                   "--input-len", str(input_len), "--output-len", str(output_len), "--no-progress"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def wait_ready(url: str, proc: subprocess.Popen, vocab: int, timeout_s: float) -> str:
    """Until /health says a worker is live (200: the scheduler answers and counts one), then one 1-token
    completion through the whole path; returns the served model id."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"serve was not ready within {timeout_s:g}s")
        with contextlib.suppress(OSError):
            if _get(url + "/health", 5)[0] == 200:
                break
        time.sleep(0.5)
    model = json.loads(_get(url + "/v1/models", 30)[1])["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": [vocab - 1] * 4, "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as resp:
        if json.loads(resp.read())["usage"]["completion_tokens"] != 1:
            raise RuntimeError("the 1-token readiness request did not return one token")
    return model


def stop(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGINT (serve's Ctrl-C: a clean stop), then SIGTERM after timeout_s, then SIGKILL 10 s later."""
    for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    return proc.wait()


@contextlib.contextmanager
def serving(serve_args: list[str], args: argparse.Namespace, vocab: int, log_path: Path,
            server: dict[str, Any]) -> Iterator[str]:
    """`radixserve serve` with its output in log_path; yields its URL; fills server with its command, start-up
    seconds, model and (after the stop) exit code."""
    port = args.port or free_port()
    argv = [sys.executable, "-m", "radixserve", "serve", "--port", str(port), *serve_args]
    server["command"] = "radixserve serve " + shlex.join(argv[4:])
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            server["model"] = wait_ready(url, proc, vocab, args.ready_timeout_s)
            server["ready_s"] = round(time.monotonic() - started, 1)
            yield url
        finally:
            server["exit_code"] = stop(proc, args.stop_timeout_s)


def hardware() -> dict[str, Any]:
    gpus: list[str] = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=10).stdout
        gpus = [n.strip() for n in names.splitlines() if n.strip()]
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"gpus": gpus, "torch": torch_version, "cpu_count": os.cpu_count(), "machine": report.client_hardware()}


def phase_summary(phase: str, rc: int, record: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a phase's result: its totals, throughput, latencies and (W6) steady state."""
    run = record["runs"][0]
    figures, sustained = run["figures"], run.get("sustained") or {}
    return {"phase": phase, "rc": rc, "bench_command": record["command"], **run["totals"],
            "duration_s": figures["duration_s"], "output_tok_s": figures["output_tok_s"],
            "ttft_p50_ms": figures["ttft"]["p50_ms"], "tpot_p50_ms": figures["tpot"]["p50_ms"],
            "cache_hit_rate": figures["cache_hit_rate"],
            **({"loop_output_tok_s": sustained["output_tok_s"], "steady_ratio": sustained["steady_ratio"],
                "steady_basis": sustained["steady_basis"]} if sustained else {})}


def run_group(group: str, phases: list[str], args: argparse.Namespace, vocab: int, out_dir: Path,
              summary: dict[str, Any]) -> None:
    serve_args = [*shlex.split(args.serve_args), *GROUP_SERVE_ARGS[group]]
    server: dict[str, Any] = {}
    summary["servers"][group] = server
    with serving(serve_args, args, vocab, out_dir / f"serve_{group}.log", server) as url:
        for phase in phases:
            argv = bench_argv(phase, args, url, vocab, out_dir)
            print(f"served_suite: {phase}: radixserve {shlex.join(argv)}", file=sys.stderr, flush=True)
            rc = run_bench(build_parser().parse_args(argv), argv[1:])
            path = out_dir / f"{phase}.json"
            record = json.loads(path.read_text())
            record["served_suite"] = {"phase": phase, "server": group, "serve_command": server["command"],
                                      "suite_command": summary["command"]}
            path.write_text(json.dumps(record, indent=1, default=str))
            summary["phases"][phase] = {"server": group, **phase_summary(phase, rc, record)}
            write_summary(summary, out_dir)


def write_summary(summary: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir or f"bench/results/served_{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    runner.raise_open_files_limit()  # before serve starts: its gateway inherits the limit
    vocab = vocab_size(shlex.split(args.serve_args), args.vocab_size)
    summary: dict[str, Any] = {
        "command": "python -m bench.served_suite " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "commit": report.commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "hardware": hardware(),
        "serve_args": args.serve_args, "vocab_size": vocab, "servers": {}, "phases": {}}
    groups: dict[str, list[str]] = {}
    for phase in args.phase_list:
        groups.setdefault(PHASES[phase][0], []).append(phase)
    for group, phases in groups.items():
        run_group(group, phases, args, vocab, out_dir, summary)
    write_summary(summary, out_dir)
    print(json.dumps(summary["phases"], indent=1, default=str))
    print(f"served_suite: wrote {out_dir / 'summary.json'}", file=sys.stderr)
    is_good = all(p["rc"] == 0 and p["num_failed"] == 0 and p["is_exact"] is not False
                  for p in summary["phases"].values())
    return 0 if is_good and all(s.get("exit_code") == 0 for s in summary["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
