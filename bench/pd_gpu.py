"""Issue 6's PD figures on one GPU, in one device call, with a time budget; JSON rewritten after every step.

Phase `transfer`: the KV handoff path alone. This process is the prefill side: it fills a KVCache (the
engine's class) of the serving model's shapes (random:llama3-8b: 32 layers, 8 KV heads, head_dim 128, bf16,
page size 16 = 2 MiB a page, K and V) and exports it as a prefill worker does (`export_pool`: CUDA IPC
handles on a GPU, shared memory on a CPU, plus a `PageServer` for the byte stream). A child process is the
decode side: with the real pullers (`make_puller`: cuda_ipc and stream on a GPU, shm and stream on a CPU)
it pulls a prompt's pages (random page ids, as in a pool that has churned) into its own KVCache, for each
prompt length, several times; per pull: bytes, seconds from `pull()` until the pages are in its cache
(device synchronised), GB/s; the median is reported. The first pull of each backend (it opens the
peer's pool) is timed apart. Every backend's last pull is checked against the source pages.

Phase `w4`: W4 `pd-mix` against two deployments of the same size on the same device, one after the
other (each alone on the GPU while measured): `radixserve serve --workers 2` (two mixed workers) and
`radixserve serve --pd 1:1` (a prefill and a decode worker, KV by CUDA IPC), each with a bounded KV pool
(`--num-pages`). After start-up (timed) and an untimed warm-up (long and chat prompts, so that Triton's
JIT and the CUDA IPC opening happen before measuring), `radixserve bench --workload pd-mix` at each
rate, then `radixserve bench --compare` per rate under the SLO (and under a tighter one, re-scored from
the same requests). Per request class (long, chat): TTFT, TPOT, and the first inter-token gap, which for
a handed-off request contains the KV handoff (KVReady, pull, first decode step).

    python -m bench.pd_gpu --out $OUT                  # the H200 run: ~7 minutes
    python -m bench.pd_gpu --out /tmp/pd --cpu-dry-run # the same machinery scaled down on a CPU: ~3 minutes

$OUT gets pd_gpu.json (every figure and exact command) and pd_gpu_artifacts.tar.gz (bench records,
compare tables and plots, server logs), both rewritten after each step so a cut-off run keeps its figures.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT_NAME = "pd_gpu.json"
ARTIFACTS_NAME = "pd_gpu_artifacts.tar.gz"
MAX_LOG_BYTES = 4 << 20  # the tail of each server log that goes into the artifacts

# --cpu-dry-run: the same phases scaled down for a 2-core CPU machine (every value can still be overridden).
DRY_RUN_DEFAULTS = dict(
    model="random:smollm2-135m", device="cpu", transfer_lens="512,2048", transfer_repeats=3, stream_repeats=2,
    w4_rates="1", w4_requests="8", input_len=32, output_len=8, long_input_len=512, long_output_len=8,
    long_fraction=0.25, slo_ttft_ms=10000.0, slo_tpot_ms=2000.0, alt_slo="4000,500", num_pages=1024,
    max_num_batched_tokens=512, max_num_seqs=16, pd_min_prefill_tokens=128, warmup_long=1, warmup_chat=2,
    probe_requests=2,
    time_budget_s=420.0, startup_estimate_s=60.0, request_timeout_s=120.0,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.pd_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/out/pd_gpu", help="results folder")
    p.add_argument("--cpu-dry-run", action="store_true", help="scaled-down defaults for a CPU machine")
    p.add_argument("--time-budget-s", type=float, default=510.0,
                   help="wall time of the whole script; steps that would not fit are skipped (and said so)")
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cpu")
    p.add_argument("--phases", default="transfer,w4", help="which phases, in order: transfer, w4")
    p.add_argument("--work-dir", default="", help="bench records, plots, logs (default /tmp/pd_gpu_work_PID); "
                                                  "packed into $OUT/pd_gpu_artifacts.tar.gz")
    t = p.add_argument_group("transfer phase")
    t.add_argument("--kv-model", default="random:llama3-8b", help="the KV shapes (a random:<preset>)")
    t.add_argument("--kv-dtype", default="bfloat16", help="the pool's dtype (the GPU engine's is bfloat16)")
    t.add_argument("--page-size", type=int, default=16, help="tokens per page (the engine's default)")
    t.add_argument("--transfer-lens", default="512,2048,8192,32768", help="prompt lengths in tokens")
    t.add_argument("--transfer-backends", default="auto",
                   help="auto: cuda_ipc,stream on a GPU, shm,stream on a CPU; or a list")
    t.add_argument("--transfer-repeats", type=int, default=10, help="pulls per length (in-memory backends)")
    t.add_argument("--stream-repeats", type=int, default=3, help="pulls per length (stream backend)")
    t.add_argument("--transfer-budget-s", type=float, default=75.0, help="most seconds for the whole phase")
    w = p.add_argument_group("w4 phase (radixserve serve + radixserve bench --workload pd-mix)")
    w.add_argument("--deployments", default="colocated,pd", help="order of the deployments (colocated, pd)")
    w.add_argument("--workers", type=int, default=2, help="colocated: mixed workers")
    w.add_argument("--pd", default="1:1", help="PD: prefill:decode workers")
    w.add_argument("--pd-policy", default="auto")
    w.add_argument("--pd-min-prefill-tokens", type=int, default=1024,
                   help="auto policy: split prompts with at least this many uncached tokens (1024: the long "
                        "prompts are split, the 256-token chat prompts run whole on the decode worker)")
    w.add_argument("--kv-transfer", default="auto")
    w.add_argument("--num-pages", type=int, default=4096,
                   help="KV pages per worker (4096 x 2 MiB = 8 GiB = 65,536 tokens of llama3-8b)")
    w.add_argument("--max-num-batched-tokens", type=int, default=2048, help="chunked-prefill step budget")
    w.add_argument("--max-num-seqs", type=int, default=128, help="also the largest CUDA-graph bucket")
    w.add_argument("--w4-rates", default="1,8", help="req/s, one bench run per rate and deployment")
    w.add_argument("--w4-requests", default="40,200", help="requests per rate (same order as --w4-rates)")
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=256)
    w.add_argument("--long-input-len", type=int, default=8192)
    w.add_argument("--long-output-len", type=int, default=256)
    w.add_argument("--long-fraction", type=float, default=0.1)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    w.add_argument("--slo-tpot-ms", type=float, default=50.0)
    w.add_argument("--alt-slo", default="300,15", help="TTFT_MS,TPOT_MS: a tighter SLO to re-score with")
    w.add_argument("--warmup-long", type=int, default=2, help="untimed long prompts before measuring")
    w.add_argument("--warmup-chat", type=int, default=8, help="untimed chat prompts before measuring")
    w.add_argument("--probe-requests", type=int, default=5,
                   help="per class: sequential 4-token requests timing the gap between the first two tokens")
    w.add_argument("--request-timeout-s", type=float, default=60.0, help="bench: per request")
    w.add_argument("--startup-estimate-s", type=float, default=75.0,
                   help="planning: expected start-up of one deployment")
    p.add_argument("--transfer-child", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--cpu-dry-run" in argv:
        parser.set_defaults(**DRY_RUN_DEFAULTS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if _cuda_available() else "cpu"
    return args


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Record:
    """pd_gpu.json, rewritten after every step; the artifacts folder packed beside it."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        from radixserve.bench.report import client_hardware, commit

        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        # everything else (bench records, plots, logs) goes to a work folder outside $OUT, packed into one
        # tarball in $OUT after each step ($OUT brings back at most 8 files)
        self.work = Path(args.work_dir or f"/tmp/pd_gpu_work_{os.getpid()}")
        self.work.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.deadline = self.start + args.time_budget_s
        self.data: dict[str, Any] = {
            "command": "python -m bench.pd_gpu " + shlex.join(argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": commit(), "host": client_hardware(), "settings": vars(args), "phases": {}, "notes": [],
            "skipped": []}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)

    def skip(self, what: str) -> None:
        self.data["skipped"].append(what)
        self.log(f"SKIPPED {what}")
        self.save()

    def save(self, pack: bool = False) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / (RESULT_NAME + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / RESULT_NAME)
        if pack:
            self.pack()

    def pack(self) -> None:
        tmp = self.out / (ARTIFACTS_NAME + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(self.work.rglob("*")):
                if not path.is_file():
                    continue
                if path.suffix == ".log" and path.stat().st_size > MAX_LOG_BYTES:
                    data = path.read_bytes()[-MAX_LOG_BYTES:]
                    info = tarfile.TarInfo(str(path.relative_to(self.work)))
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.add(path, arcname=str(path.relative_to(self.work)))
        tmp.replace(self.out / ARTIFACTS_NAME)


# --- phase 1: the transfer path --------------------------------------------------------------------------

def transfer_backends(args: argparse.Namespace) -> list[str]:
    if args.transfer_backends != "auto":
        return [b.strip() for b in args.transfer_backends.split(",") if b.strip()]
    return ["cuda_ipc", "stream"] if args.device.startswith("cuda") else ["shm", "stream"]


def kv_shape(kv_model: str) -> tuple[int, int, int]:
    from services.gpu_worker.model.presets import preset

    if not kv_model.startswith("random:"):
        raise ValueError("--kv-model must be a random:<preset> (only its shapes are used)")
    cfg = preset(kv_model.removeprefix("random:"))
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim


class _PageServerThread:
    """The prefill side's stream backend: a PageServer on its own event loop, every lease valid."""

    def __init__(self, addr: str, kv) -> None:
        import asyncio
        import queue

        self._ready: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task = None

        def read_pages(page_ids: list[int]):
            import torch
            index = torch.tensor(page_ids, dtype=torch.long, device=kv.k.device)
            return kv.k.index_select(1, index), kv.v.index_select(1, index)

        async def main() -> None:
            from services.gpu_worker.kv_transfer.stream import PageServer

            server = PageServer(addr, lambda lease_id, page_ids: True, read_pages)
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._ready.put(server.addr)
            try:
                await server.serve_forever()
            except asyncio.CancelledError:
                pass
            finally:
                server.close()

        def run() -> None:
            try:
                asyncio.run(main())
            except Exception as exc:  # noqa: BLE001 - reported to the waiting caller
                self._ready.put(exc)

        self._thread = threading.Thread(target=run, name="page-server", daemon=True)
        self._thread.start()
        got = self._ready.get(timeout=30)
        if isinstance(got, Exception):
            raise got
        self.addr: str = got

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=5)


def run_transfer(args: argparse.Namespace, rec: Record) -> dict[str, Any]:
    """This process exports a filled pool; a child process pulls from it with each backend."""
    import tempfile

    import torch

    from services.gpu_worker.kv_cache import KVCache
    from services.gpu_worker.kv_transfer.base import DTYPES
    from services.gpu_worker.kv_transfer.export import export_pool
    from shared.messages import encode

    layers, kv_heads, head_dim = kv_shape(args.kv_model)
    dtype = DTYPES[args.kv_dtype]
    lens = ints(args.transfer_lens)
    max_pages = max(-(-n // args.page_size) for n in lens)
    num_pages = max_pages + 65  # page 0 reserved, plus slack so the longest prompt's ids are not all pages
    device = torch.device(args.device)
    bytes_per_page = KVCache.bytes_per_page(layers, args.page_size, kv_heads, head_dim, dtype)
    result: dict[str, Any] = {
        "kv_model": args.kv_model, "shape": {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim,
                                             "page_size": args.page_size, "dtype": args.kv_dtype},
        "bytes_per_page": bytes_per_page, "bytes_per_token": bytes_per_page // args.page_size,
        "pool_pages_each_side": num_pages, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "method": "prefill side = this process (KVCache filled with normal noise, export_pool as a prefill "
                  "worker does, PageServer for stream); decode side = a child process with make_puller(backend); "
                  "latency = wall time of puller.pull() for one request's pages plus a device synchronize; random "
                  "distinct source and destination page ids; median over repeats; GB/s = payload bytes (K+V of "
                  "the pages, one way) / median seconds; first_pull_s = the first 1-page pull (opens the pool)",
        "backends": {}}
    kv = KVCache(layers, num_pages, args.page_size, kv_heads, head_dim, dtype, device)
    gen = torch.Generator(device=device).manual_seed(1234)
    for t in (kv.k, kv.v):
        t.normal_(generator=gen)
    if device.type == "cuda":
        torch.cuda.synchronize()
    run_dir = Path(tempfile.mkdtemp(prefix="pd-gpu-"))
    server = _PageServerThread(f"ipc://{run_dir / 'pages'}", kv)
    exported = export_pool(kv, socket.gethostname(), f"pd-gpu-{os.getpid()}", server.addr)
    plan = {"backends": transfer_backends(args), "lens": lens, "page_size": args.page_size,
            "num_pages": num_pages, "repeats": args.transfer_repeats, "stream_repeats": args.stream_repeats,
            "device": str(device), "deadline_unix": time.time() + min(args.transfer_budget_s, rec.left() - 10)}
    try:
        cmd = [sys.executable, "-m", "bench.pd_gpu", "--transfer-child", json.dumps(plan)]
        rec.log(f"transfer: {layers} layers x {kv_heads} KV heads x {head_dim}, {args.kv_dtype}, "
                f"{bytes_per_page / 2**20:.2f} MiB/page, {num_pages} pages each side; backends {plan['backends']}")
        started = time.monotonic()
        child = subprocess.run(cmd, input=encode(exported.source), capture_output=True, cwd=ROOT,
                               timeout=max(30.0, plan["deadline_unix"] - time.time() + 60))
        result["child_seconds"] = round(time.monotonic() - started, 1)
        (rec.work / "transfer_child.log").write_bytes(child.stderr[-MAX_LOG_BYTES:])
        lines = [json.loads(line) for line in child.stdout.decode().splitlines() if line.startswith("{")]
        if child.returncode != 0:
            result["error"] = f"child exited {child.returncode}: {child.stderr.decode()[-1500:]}"
        for line in lines:
            check = line.pop("check", None)
            if check is not None:
                line["verified"] = _verify(kv, check)
            result["backends"].setdefault(line["backend"], {})[str(line.get("tokens", "open"))] = line
    finally:
        server.stop()
        exported.close()
    del kv, server, exported  # the pool's memory goes back to the driver before the servers start
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["table"] = _transfer_table(result)
    return result


def _verify(kv, check: dict[str, Any]) -> bool:
    """The child's sums of the pulled pages equal this pool's sums of the source pages."""
    import torch

    index = torch.tensor(check["src"], dtype=torch.long, device=kv.k.device)
    k_sum = float(kv.k.index_select(1, index).sum(dtype=torch.float64))
    v_sum = float(kv.v.index_select(1, index).sum(dtype=torch.float64))
    return math.isclose(k_sum, check["k_sum"], rel_tol=1e-9, abs_tol=1e-6) and \
        math.isclose(v_sum, check["v_sum"], rel_tol=1e-9, abs_tol=1e-6)


def _transfer_table(result: dict[str, Any]) -> list[str]:
    rows = ["backend   tokens   MiB      median ms   GB/s     min ms   max ms   n   ok"]
    for backend, by_len in result["backends"].items():
        for key, r in by_len.items():
            if "error" in r:
                rows.append(f"{backend:9s} {key:8s} ERROR {r['error'][:200]}")
                continue
            if key == "open":
                rows.append(f"{backend:9s} open     -        {r['first_pull_s'] * 1e3:9.2f}   -        -        -")
                continue
            if not r.get("seconds"):
                continue
            rows.append(f"{backend:9s} {r['tokens']:<8d} {r['bytes'] / 2**20:<8.0f} {r['median_s'] * 1e3:9.3f}   "
                        f"{r['gb_s']:<8.1f} {min(r['seconds']) * 1e3:<8.3f} {max(r['seconds']) * 1e3:<8.3f} "
                        f"{len(r['seconds']):<3d} {r.get('verified', '-')}")
    return rows


def transfer_child(plan_json: str) -> int:
    """The decode side: pull from the source on stdin with each backend; one JSON line per result."""
    import torch

    from services.gpu_worker.kv_cache import KVCache
    from services.gpu_worker.kv_transfer import make_puller
    from services.gpu_worker.kv_transfer.base import DTYPES
    from shared.messages import KVSource, decode

    plan = json.loads(plan_json)
    source = decode(sys.stdin.buffer.read(), KVSource)
    device = torch.device(plan["device"])
    dtype = DTYPES[source.dtype]
    kv = KVCache(source.num_layers, plan["num_pages"], source.page_size, source.num_kv_heads, source.head_dim,
                 dtype, device)
    rng = random.Random(7)
    deadline = plan["deadline_unix"]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def emit(line: dict[str, Any]) -> None:
        print(json.dumps(line), flush=True)

    for backend in plan["backends"]:
        try:
            puller = make_puller(backend)
            sync()
            t0 = time.perf_counter()
            puller.pull(source, "bench", [1], [1], kv)
            sync()
            emit({"backend": backend, "first_pull_s": time.perf_counter() - t0})
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported, the others go on
            emit({"backend": backend, "error": repr(exc)})
            continue
        repeats = plan["stream_repeats"] if backend == "stream" else plan["repeats"]
        for tokens in plan["lens"]:
            n = -(-tokens // source.page_size)
            line: dict[str, Any] = {"backend": backend, "tokens": tokens, "num_pages": n, "seconds": []}
            src = dst = []
            try:
                for _ in range(repeats):
                    if time.time() > deadline:
                        line["cut_short"] = "transfer budget spent"
                        break
                    src = rng.sample(range(1, source.num_pages), n)
                    dst = rng.sample(range(1, plan["num_pages"]), n)
                    sync()
                    t0 = time.perf_counter()
                    num_bytes = puller.pull(source, "bench", src, dst, kv)
                    sync()
                    line["seconds"].append(time.perf_counter() - t0)
                    line["bytes"] = num_bytes
            except Exception as exc:  # noqa: BLE001
                line["error"] = repr(exc)
            if line["seconds"]:
                line["median_s"] = statistics.median(line["seconds"])
                line["gb_s"] = line["bytes"] / line["median_s"] / 1e9
                index = torch.tensor(dst, dtype=torch.long, device=device)
                line["check"] = {"src": src, "k_sum": float(kv.k.index_select(1, index).sum(dtype=torch.float64)),
                                 "v_sum": float(kv.v.index_select(1, index).sum(dtype=torch.float64))}
                if device.type == "cuda" and backend == plan["backends"][0]:
                    line["contiguous_copy_gb_s"] = _copy_ceiling(line["bytes"], dtype, device)
            emit(line)
    return 0


def _copy_ceiling(num_bytes: int, dtype, device) -> float:
    """The same payload as one contiguous device-to-device copy in this process (one way, GB/s)."""
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    a = torch.empty(num_bytes // elem, dtype=dtype, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return num_bytes / statistics.median(times) / 1e9


# --- phase 2: W4 pd-mix, PD vs colocated ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deployment_args(args: argparse.Namespace, kind: str) -> list[str]:
    common = ["--model", args.model, "--device", args.device, "--num-pages", str(args.num_pages),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
              "--drain-timeout", "1"]
    if kind == "colocated":
        return common + ["--workers", str(args.workers)]
    if kind == "pd":
        return common + ["--pd", args.pd, "--pd-policy", args.pd_policy, "--pd-min-prefill-tokens",
                         str(args.pd_min_prefill_tokens), "--kv-transfer", args.kv_transfer]
    raise ValueError(f"unknown deployment {kind!r} (colocated, pd)")


def num_workers(args: argparse.Namespace, kind: str) -> int:
    return args.workers if kind == "colocated" else sum(ints(args.pd.replace(":", ",")))


class Server:
    """One `radixserve serve` in its own process group, its output in a log file."""

    def __init__(self, args: argparse.Namespace, kind: str, rec: Record) -> None:
        self.kind, self.rec = kind, rec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve_args = deployment_args(args, kind) + ["--port", str(self.port)]
        self.command = "radixserve serve " + shlex.join(self.serve_args)
        self.log_path = rec.work / f"serve_{kind}.log"
        self.expected_workers = num_workers(args, kind)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        """Start and wait until /health answers and every worker printed 'model loaded'; the seconds taken."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes to it until stop()
        started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", *self.serve_args], cwd=ROOT,
                                     env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve ({self.kind}) exited with {self.proc.returncode}; log tail:\n"
                                   + self.log_tail())
            if self._workers_loaded() >= self.expected_workers and self._healthy():
                time.sleep(1.0)  # the last worker's first heartbeat reaches the scheduler
                return time.monotonic() - started
            time.sleep(0.5)
        raise TimeoutError(f"serve ({self.kind}) not ready within {timeout_s:.0f}s; log tail:\n" + self.log_tail())

    def _workers_loaded(self) -> int:
        """Workers the scheduler registered (a prefill worker registers only after exporting its pool)."""
        import re
        try:
            text = self.log_path.read_bytes()
        except OSError:
            return 0
        return len(set(re.findall(rb"worker registered[^\n]*?worker_id=(\S+)", text)))

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, num_bytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def load_times(self) -> list[float]:
        """Each worker's own 'model loaded in X s' (model, KV pool, Triton JIT, CUDA graphs)."""
        import re
        text = self.log_path.read_text(errors="replace")
        return [float(x) for x in re.findall(r": model loaded in ([0-9.]+)s", text)]

    def log_counts(self) -> dict[str, int]:
        text = self.log_path.read_text(errors="replace")
        return {"kv_pull_failed": text.count("kv pull failed"), "lease_expired": text.count("lease expired"),
                "tracebacks": text.count("Traceback"), "has_cuda_ipc_export": text.count("has_cuda_ipc=True")}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # serve drains (1 s), then stops its children
        try:
            self.proc.wait(45)
        except subprocess.TimeoutExpired:
            self._kill_tree()

    def _kill_tree(self) -> None:
        """SIGKILL the serve process and its descendants, each by pid."""
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=10)


def bench_cli(argv: list[str], rec: Record, name: str) -> tuple[int, str]:
    """`radixserve bench ARGV` in this process; its stdout is also kept in work/NAME.txt."""
    from radixserve.cli import main as radixserve_main

    buf = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            buf.write(text)
            sys.__stdout__.write(text)
            return len(text)

        def flush(self) -> None:
            sys.__stdout__.flush()

    try:
        with contextlib.redirect_stdout(Tee()):
            code = radixserve_main(["bench", *argv])
    except SystemExit as exc:  # argparse errors
        code = int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - a failed bench is recorded; the script goes on
        buf.write(f"\nbench raised {exc!r}\n")
        code = 99
    (rec.work / f"{name}.txt").write_text(buf.getvalue())
    return code, buf.getvalue()


def w4_argv(args: argparse.Namespace, url: str, rate: float, num_requests: int, name: str,
            out_dir: Path, vocab: int) -> list[str]:
    return ["--base-url", url, "--workload", "pd-mix", "--num-requests", str(num_requests),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--long-input-len", str(args.long_input_len), "--long-output-len", str(args.long_output_len),
            "--long-fraction", str(args.long_fraction), "--rate", f"{rate:g}", "--seed", str(args.seed),
            "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
            "--vocab-size", str(vocab), "--timeout-s", f"{args.request_timeout_s:g}",
            "--hardware", _hardware(args), "--out-dir", str(out_dir), "--name", name, "--no-plots", "--no-progress"]


def warmup_argvs(args: argparse.Namespace, url: str, out_dir: Path, vocab: int, kind: str) -> list[list[str]]:
    """Untimed: long prompts (Triton JIT of the long extend shapes, PD's first handoffs) then chat prompts."""
    base = ["--base-url", url, "--workload", "custom", "--rate", "inf", "--vocab-size", str(vocab),
            "--seed", "99", "--out-dir", str(out_dir), "--no-plots", "--no-progress", "--timeout-s", "300"]
    out = []
    if args.warmup_long:
        out.append(base + ["--num-requests", str(args.warmup_long), "--input-len", str(args.long_input_len),
                           "--output-len", "8", "--name", f"warmup_{kind}_long"])
    if args.warmup_chat:
        out.append(base + ["--num-requests", str(args.warmup_chat), "--input-len", str(args.input_len),
                           "--output-len", "8", "--name", f"warmup_{kind}_chat"])
    return out


def probe_first_gaps(url: str, lengths: dict[str, int], num: int, vocab: int, seed: int) -> dict[str, Any]:
    """One request at a time (idle server), 4 output tokens each: TTFT and the gap between the first two
    streamed tokens. Under PD the first token comes from the prefill worker and the second from the decode
    worker after the KV handoff (KVReady, pull, first decode step); colocated, the gap is one decode step.
    Every SSE event with a choice counts (a random model streams empty text, which the bench's ITL skips)."""
    import asyncio

    import aiohttp

    async def one(http: aiohttp.ClientSession, model: str, prompt: list[int]) -> tuple[float, float | None, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        times: list[float] = []
        t0 = time.perf_counter()
        async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    if json.loads(line[5:]).get("choices"):
                        times.append(time.perf_counter())
        return times[0] - t0, (times[1] - times[0]) if len(times) > 1 else None, len(times)

    async def main() -> dict[str, Any]:
        rng = random.Random(seed)
        out: dict[str, Any] = {"max_tokens": 4, "requests_per_class": num}
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            for cls, length in lengths.items():
                ttft, gaps, events = [], [], []
                for _ in range(num):
                    prompt = [rng.randrange(1000, vocab) for _ in range(length)]
                    t, gap, n = await one(http, model, prompt)
                    ttft.append(t * 1e3)
                    events.append(n)
                    if gap is not None:
                        gaps.append(gap * 1e3)
                out[cls] = {"prompt_tokens": length, "ttft_ms": [round(x, 2) for x in ttft],
                            "first_gap_ms": [round(x, 2) for x in gaps], "ttft_p50_ms": median(ttft),
                            "first_gap_p50_ms": median(gaps), "events_per_request": events}
        return out

    try:
        return asyncio.run(main())
    except Exception as exc:  # noqa: BLE001 - a failed probe is recorded, the runs go on
        return {"error": repr(exc)[:1000]}


def _hardware(args: argparse.Namespace) -> str:
    if args.device.startswith("cuda"):
        import torch
        return f"{torch.cuda.get_device_name()} (one GPU shared by the deployment's worker processes)"
    return f"CPU ({os.cpu_count()} cores), scaled-down dry run"


def gpu_used_gib(args: argparse.Namespace) -> float | None:
    if not args.device.startswith("cuda"):
        return None
    import torch
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


def class_stats(bench_json: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT, TPOT and first inter-token gap per request class, from the bench record's requests."""
    record = json.loads(bench_json.read_text())
    reqs = record["runs"][0]["requests"]
    threshold = (args.input_len + args.long_input_len) / 2
    out: dict[str, Any] = {}
    for cls, members in (("long", [r for r in reqs if r["num_prompt_tokens"] >= threshold]),
                         ("chat", [r for r in reqs if r["num_prompt_tokens"] < threshold])):
        ok = [r for r in members if r.get("error_kind") is None]
        ttft = [r["ttft_s"] * 1e3 for r in ok if r.get("ttft_s") is not None]
        tpot = [r["tpot_s"] * 1e3 for r in ok if r.get("tpot_s") is not None]
        first_gap = [r["itl_s"][0] * 1e3 for r in ok if r.get("itl_s")]
        out[cls] = {"num": len(members), "num_ok": len(ok),
                    "ttft_ms": {"p50": median(ttft), "p90": pct(ttft, 90), "max": max(ttft, default=None)},
                    "tpot_ms": {"p50": median(tpot), "p99": pct(tpot, 99)},
                    "first_itl_ms": {"p50": median(first_gap), "p90": pct(first_gap, 90)}}
    return out


def headline(bench_json: Path) -> dict[str, Any]:
    record = json.loads(bench_json.read_text())
    f = record["runs"][0]["figures"]
    keep = ("num_requests", "num_ok", "num_errors", "errors", "num_short_outputs", "duration_s", "request_throughput",
            "output_tok_s", "num_good", "goodput", "slo_ttft_ms", "slo_tpot_ms")
    out = {k: f.get(k) for k in keep}
    for name, stats in (("ttft", ("p50", "p90", "p99")), ("tpot", ("p50", "p99")), ("itl", ("p50", "p99")),
                        ("e2e", ("p50", "p90"))):
        for s in stats:
            out[f"{name}_{s}_ms"] = (f.get(name) or {}).get(f"{s}_ms")
    out["command"] = record.get("command")
    return out


def run_w4(args: argparse.Namespace, rec: Record) -> None:
    from services.gpu_worker.model.presets import preset

    vocab = preset(args.model.removeprefix("random:")).vocab_size if args.model.startswith("random:") else 32000
    rates, counts = floats(args.w4_rates), ints(args.w4_requests)
    if len(rates) != len(counts):
        raise ValueError("--w4-rates and --w4-requests need the same number of entries")
    kinds = [k.strip() for k in args.deployments.split(",") if k.strip()]
    out_dir = rec.work / "bench"
    phase: dict[str, Any] = {
        "workload": {"name": "w4 pd-mix", "chat": f"{args.input_len} -> {args.output_len}",
                     "long": f"{args.long_input_len} -> {args.long_output_len}", "long_fraction": args.long_fraction,
                     "arrival": "uniform (bench's W4 default)", "seed": args.seed, "prompts": "random token ids",
                     "ignore_eos": True, "temperature": 0.0},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "alt": args.alt_slo},
        "baseline_gpu_used_gib": gpu_used_gib(args), "deployments": {}, "compare": {},
        "notes": [
            "deployments run one after the other, each alone on the device while measured (the other is stopped)",
            "a deployment's worker processes share the one GPU by time-slicing (no MPS)",
            "random:* models stream empty text, so the bench's ITL figures are empty; TTFT (first streamed "
            "choice), TPOT ((e2e - ttft) / (completion_tokens - 1), usage) and goodput are exact; "
            "first_gap_probe times the gap between the first two streamed tokens on an idle server instead",
            "ready = /health answers and the scheduler logged every worker as registered; untimed warm-up "
            "(long and chat prompts) before the probe and the runs"]}
    rec.data["phases"]["w4"] = phase
    rec.save()
    plan = fit_plan(list(zip(rates, counts)), len(kinds), rec.left(), args.startup_estimate_s)
    for rate, n in [(r, n) for r, n in zip(rates, counts) if (r, n) not in plan]:
        rec.skip(f"w4 rate {rate:g} x {n}: would not fit the budget ({rec.left():.0f}s left at planning)")
    phase["planned_rates"] = [r for r, _ in plan]
    done_first: set[float] | None = None  # the rates the first deployment measured (later ones pair with them)
    startup_est = args.startup_estimate_s  # for the deployments still to start; the first one's actual after it
    for i, kind in enumerate(kinds):
        dep: dict[str, Any] = {"runs": {}}
        phase["deployments"][kind] = dep
        num_later = len(kinds) - i - 1
        todo = [(r, n) for r, n in plan if done_first is None or r in done_first]
        min_runs_s = runs_seconds(todo[:1])  # start-up may eat into the later rates, never into the first
        startup_allowed = min(600.0, rec.left() - min_runs_s - 30 - num_later * (startup_est + min_runs_s + 30))
        if not todo or startup_allowed < 30:
            rec.skip(f"w4 {kind}: {rec.left():.0f}s left, not enough for start-up and {min_runs_s:.0f}s of runs")
            continue
        server = Server(args, kind, rec)
        dep["serve_command"] = server.command
        dep["serve_argv_as_run"] = shlex.join([sys.executable, "-m", "radixserve", "serve", *server.serve_args])
        rec.log(f"w4 {kind}: {server.command}  (start-up allowed {startup_allowed:.0f}s)")
        try:
            dep["startup_s"] = round(server.start(startup_allowed), 1)
            dep["worker_load_s"] = server.load_times()
            dep["gpu_used_gib_when_ready"] = gpu_used_gib(args)
            rec.log(f"w4 {kind}: ready in {dep['startup_s']}s (workers: {dep['worker_load_s']}), "
                    f"GPU used {dep['gpu_used_gib_when_ready']} GiB")
            rec.save(pack=True)
            t0 = time.monotonic()
            dep["warmup_commands"] = []
            for argv in warmup_argvs(args, server.url, rec.work / "warmup", vocab, kind):
                dep["warmup_commands"].append("radixserve bench " + shlex.join(argv))
                code, _ = bench_cli(argv, rec, argv[argv.index("--name") + 1])
                if code != 0:
                    rec.data["notes"].append(f"w4 {kind}: a warm-up bench exited {code}")
            dep["warmup_s"] = round(time.monotonic() - t0, 1)
            if i == 0:
                startup_est = dep["startup_s"]
            fitted = fit_runs(todo, rec.left(), num_later, startup_est)
            for rate, n in todo[len(fitted):]:
                rec.skip(f"w4 rate {rate:g} x {n} ({kind} and later): start-up took {dep['startup_s']}s, "
                         f"{rec.left():.0f}s left")
            todo = fitted
            if args.probe_requests:
                dep["first_gap_probe"] = probe_first_gaps(server.url, {"long": args.long_input_len,
                                                                       "chat": args.input_len},
                                                          args.probe_requests, vocab, args.seed + 1000)
                rec.log(f"w4 {kind}: first-gap probe {json.dumps(dep['first_gap_probe'])}")
                rec.save()
            for rate, n in todo:
                name = f"w4_{kind}_r{rate:g}"
                if rec.left() < n / rate + 10:
                    rec.skip(f"w4 {kind} rate {rate:g}: {rec.left():.0f}s left")
                    continue
                argv = w4_argv(args, server.url, rate, n, name, out_dir, vocab)
                rec.log(f"w4 {kind}: rate {rate:g} req/s x {n} requests")
                code, _ = bench_cli(argv, rec, name)
                path = out_dir / f"{name}.json"
                run: dict[str, Any] = {"exit_code": code, "bench_command": "radixserve bench " + shlex.join(argv)}
                if path.exists():
                    run.update(headline(path))
                    run["by_class"] = class_stats(path, args)
                dep["runs"][f"{rate:g}"] = run
                rec.save(pack=True)
            dep["log_counts"] = server.log_counts()
        except Exception as exc:  # noqa: BLE001 - record, stop this deployment, go on with the next
            dep["error"] = repr(exc)[:4000]
            rec.log(f"w4 {kind}: FAILED {exc!r}"[:3000])
        finally:
            if done_first is None and dep["runs"]:
                done_first = {float(r) for r in dep["runs"]}
            t0 = time.monotonic()
            server.stop()
            dep["stop_s"] = round(time.monotonic() - t0, 1)
            dep["gpu_used_gib_after_stop"] = _wait_gpu_released(args, phase["baseline_gpu_used_gib"])
            rec.save(pack=True)
    compare_all(args, rec, phase, kinds, rates, out_dir)


def runs_seconds(plan: list[tuple[float, int]]) -> float:
    """Planning: each run's arrival span plus its tail, and a warm-up."""
    return sum(n / r + 10 for r, n in plan) + 15


def fit_plan(pairs: list[tuple[float, int]], num_deployments: int, left_s: float,
             startup_s: float) -> list[tuple[float, int]]:
    """The (rate, requests) pairs, dropping from the end until every deployment's start-up and runs fit."""
    plan = list(pairs)
    while plan and num_deployments * (startup_s + runs_seconds(plan) + 30) > left_s:
        plan.pop()
    return plan


def fit_runs(todo: list[tuple[float, int]], left_s: float, num_later: int,
             startup_s: float) -> list[tuple[float, int]]:
    """The longest prefix of todo whose runs, here and on the deployments still to start, fit left_s."""
    runs = list(todo)
    while runs and runs_seconds(runs) + 30 + num_later * (startup_s + runs_seconds(runs) + 30) > left_s:
        runs.pop()
    return runs


def _wait_gpu_released(args: argparse.Namespace, baseline: float | None) -> float | None:
    if baseline is None:
        return None
    deadline = time.monotonic() + 20
    used = gpu_used_gib(args)
    while used is not None and used > baseline + 1.0 and time.monotonic() < deadline:
        time.sleep(0.5)
        used = gpu_used_gib(args)
    return used


def compare_all(args: argparse.Namespace, rec: Record, phase: dict[str, Any], kinds: list[str], rates: list[float],
                out_dir: Path) -> None:
    """`radixserve bench --compare` per rate: under the SLO (with a plot) and re-scored under the tighter one."""
    alt = floats(args.alt_slo)
    for rate in rates:
        paths = [out_dir / f"w4_{k}_r{rate:g}.json" for k in kinds]
        if not all(p.exists() for p in paths):
            continue
        result: dict[str, Any] = {}
        for label, slo in (("slo", (args.slo_ttft_ms, args.slo_tpot_ms)), ("alt_slo", tuple(alt))):
            if len(slo) != 2:
                continue
            name = f"compare_w4_r{rate:g}_{label}"
            argv = ["--compare", *map(str, paths), "--slo-ttft-ms", f"{slo[0]:g}", "--slo-tpot-ms", f"{slo[1]:g}",
                    "--out-dir", str(rec.work / "plots"), "--name", name]
            if label != "slo":
                argv.append("--no-plots")
            code, text = bench_cli(argv, rec, name)
            answer = next((line for line in text.splitlines() if line.startswith("answer:")), None)
            result[label] = {"command": "radixserve bench " + shlex.join(argv), "exit_code": code, "answer": answer,
                             "table": text}
            rec.log(f"w4 rate {rate:g} ({label} {slo[0]:g}/{slo[1]:g} ms): {answer}")
        phase["compare"][f"{rate:g}"] = result
        rec.save(pack=True)


# --- main -------------------------------------------------------------------------------------------------

class Terminated(BaseException):
    """SIGTERM (e.g. an outer `timeout`): unwinds every step (a running server is stopped in `finally`)."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.transfer_child is not None:
        return transfer_child(args.transfer_child)
    signal.signal(signal.SIGTERM, _on_sigterm)
    rec = Record(args, argv)
    rec.log(f"pd_gpu: device {args.device}, model {args.model}, budget {args.time_budget_s:.0f}s, out {rec.out}")
    if args.device.startswith("cuda"):
        import torch
        props = torch.cuda.get_device_properties(0)
        rec.data["gpu"] = {"name": props.name, "total_gib": round(props.total_memory / 2**30, 1),
                           "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        run_phases(args, rec)
    except Terminated:
        rec.data["notes"].append(f"terminated by SIGTERM after {rec.elapsed():.0f}s")
        rec.log("terminated by SIGTERM")
        rec.save(pack=True)
        print_summary(rec)
        return 143
    rec.save(pack=True)
    print_summary(rec)
    return 0


def run_phases(args: argparse.Namespace, rec: Record) -> None:
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if "transfer" in phases:
        try:
            result = run_transfer(args, rec)
        except Exception as exc:  # noqa: BLE001 - record it; the W4 phase still runs
            result = {"error": repr(exc)[:4000]}
        rec.data["phases"]["transfer"] = result
        rec.save(pack=True)
        rec.log("transfer:\n  " + "\n  ".join(result.get("table", [])) + (f"\n  error: {result['error']}"
                                                                          if "error" in result else ""))
    if "w4" in phases:
        try:
            run_w4(args, rec)
        except Exception as exc:  # noqa: BLE001
            rec.data["phases"].setdefault("w4", {})["error"] = repr(exc)[:4000]
            rec.log(f"w4 FAILED: {exc!r}")


def print_summary(rec: Record) -> None:
    w4 = rec.data["phases"].get("w4", {})
    lines = [f"pd_gpu done in {rec.elapsed():.0f}s; skipped: {rec.data['skipped'] or 'nothing'}"]
    for kind, dep in w4.get("deployments", {}).items():
        lines.append(f"{kind}: startup {dep.get('startup_s')}s, workers {dep.get('worker_load_s')}, "
                     f"GPU {dep.get('gpu_used_gib_when_ready')} GiB, log {dep.get('log_counts')}"
                     + (f", ERROR {dep['error'][:300]}" if dep.get("error") else ""))
        for rate, run in dep.get("runs", {}).items():
            lines.append(f"  rate {rate}: ok {run.get('num_ok')}/{run.get('num_requests')}, "
                         f"TTFT p50/p90 {_ms(run.get('ttft_p50_ms'))}/{_ms(run.get('ttft_p90_ms'))} ms, "
                         f"TPOT p50/p99 {_ms(run.get('tpot_p50_ms'))}/{_ms(run.get('tpot_p99_ms'))} ms, "
                         f"out {_ms(run.get('output_tok_s'))} tok/s, goodput {run.get('goodput')}")
            for cls, s in (run.get("by_class") or {}).items():
                ttft, tpot = s["ttft_ms"], s["tpot_ms"]
                lines.append(f"    {cls}: n {s['num']}, TTFT p50/p90 {_ms(ttft['p50'])}/{_ms(ttft['p90'])} ms, "
                             f"TPOT p50/p99 {_ms(tpot['p50'])}/{_ms(tpot['p99'])} ms")
        probe = dep.get("first_gap_probe") or {}
        for cls in ("long", "chat"):
            if cls in probe:
                lines.append(f"  probe {cls}: TTFT p50 {_ms(probe[cls]['ttft_p50_ms'])} ms, first gap p50 "
                             f"{_ms(probe[cls]['first_gap_p50_ms'])} ms")
    for rate, cmp in w4.get("compare", {}).items():
        for label, r in cmp.items():
            lines.append(f"compare rate {rate} {label}: {r.get('answer')}")
    print("\n".join(lines), flush=True)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
