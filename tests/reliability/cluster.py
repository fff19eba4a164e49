"""Real radixserve processes for the reliability suite: single services over ipc:// (so a test can kill and
restart any one of them), a killable Redis, and the probes the tests assert with: a scheduler status query,
an observer that receives every worker's heartbeats (load, free KV pages) and RequestFinished, and the
global index in Redis."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import zmq

from shared.messages import (RequestFinished, SchedulerInbound, StatusReply, StatusRequest, WorkerHeartbeat,
                             WorkerLoad, decode, encode)
from tests.service.redis_fixtures import RedisProcess, live_worker_blocks

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny-llama"  # random weights, no tokenizer: prompts are token ids on /v1/completions
VOCAB = 512


def wait_until(predicate: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.02) -> Any:
    """predicate()'s first truthy value; TimeoutError when none came within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One child process (`python -m <module> <args>`), logging to log_dir/<name>.log."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log_dir / f"{name}.log"
        self.env = {**os.environ, "RADIXSERVE_LOG_JSON": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Service:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env)
        return self

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_events(self, event: str) -> list[dict[str, Any]]:
        """Every JSON log line of this service (all its runs) whose event is `event`."""
        lines = (json.loads(line) for line in self.log_text().splitlines() if line.startswith("{"))
        return [e for e in lines if e.get("event") == event]


class RouterThread:
    """A ROUTER bound at addr and served by a daemon thread: each SchedulerInbound it receives goes to
    handle(identity, msg); send() answers on the same socket (from the handler's thread)."""

    def __init__(self, ctx: zmq.Context, addr: str, handle: Callable[[bytes, Any], None], poll_ms: int = 50) -> None:
        self._handle, self._poll_ms = handle, poll_ms
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self._sock.poll(self._poll_ms):
                continue
            identity, *_, frame = self._sock.recv_multipart()
            self._handle(identity, decode(frame, SchedulerInbound))

    def send(self, identity: bytes, msg: Any) -> None:
        self._sock.send_multipart([identity, encode(msg)])

    def close(self, timeout_s: float) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)
        self._sock.close()


class Observer:
    """A ROUTER that workers treat as one more scheduler: it keeps each worker's latest heartbeat and every
    RequestFinished, so tests read worker load and KV pages without touching the real scheduler."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.heartbeats: dict[str, WorkerHeartbeat] = {}
        self.heartbeat_at: dict[str, float] = {}
        self.finished: list[RequestFinished] = []
        self._ctx = zmq.Context()
        self._router = RouterThread(self._ctx, addr, self._on_message)

    def _on_message(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, WorkerHeartbeat):
            self.heartbeats[msg.worker_id] = msg
            self.heartbeat_at[msg.worker_id] = time.monotonic()
        elif isinstance(msg, RequestFinished):
            self.finished.append(msg)

    def load(self, worker_id: str, fresher_than_s: float = 1.0) -> WorkerLoad | None:
        """The worker's load from a heartbeat received within fresher_than_s, else None."""
        at = self.heartbeat_at.get(worker_id)
        if at is None or time.monotonic() - at > fresher_than_s:
            return None
        return self.heartbeats[worker_id].load

    def close(self) -> None:
        self._router.close(2)
        self._ctx.destroy(linger=0)


def scheduler_status(addr: str, timeout_s: float = 2.0) -> StatusReply | None:
    """Ask a scheduler for its StatusReply (as a gateway does); None when it does not answer in time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(encode(StatusRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return decode(sock.recv_multipart()[-1], StatusReply)
    finally:
        sock.close()


def zmq_socket(ctx: zmq.Context, kind: int, addr: str, bind: bool = False, rcvhwm: int = 1000) -> zmq.Socket:
    """A test's socket bound or connected at addr; it queues without limit what it sends."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(addr) if bind else sock.connect(addr)
    return sock


def http_status(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


class Cluster:
    """Services started one by one over ipc:// in a short temp dir (unix socket paths are limited to ~107 bytes).

    Addresses: scheduler (scheduler<i> for the i-th of several), cache_index, observer, worker<i>, tokenizer<i>
    (+ -stream); Redis on a unix socket. Workers, tokenizers and gateways are given every scheduler.
    """

    def __init__(self, log_dir: Path, num_schedulers: int = 1) -> None:
        self.sock_dir = Path(tempfile.mkdtemp(prefix="rsrel"))
        self.log_dir = log_dir
        self.num_schedulers = num_schedulers
        self.services: dict[str, Service] = {}
        self.redis = RedisProcess(self.sock_dir / "redis.sock")
        self.observer: Observer | None = None
        self.gateway_port = 0

    def ipc(self, name: str) -> str:
        return f"ipc://{self.sock_dir / name}"

    @property
    def scheduler_addr(self) -> str:
        return self.ipc("scheduler")

    @property
    def scheduler_addrs(self) -> list[str]:
        return [self.ipc(scheduler_name(i)) for i in range(self.num_schedulers)]

    @property
    def cache_index_addr(self) -> str:
        return self.ipc("cache_index")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def redis_client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.redis.sock_path), socket_timeout=2)

    def worker_blocks(self, worker_id: str) -> set[int]:
        """The block hashes the global index says worker_id holds (empty when Redis is down)."""
        try:
            return live_worker_blocks(str(self.redis.sock_path), worker_id)
        except (redis.RedisError, OSError):
            return set()

    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        service = self.services[name] = Service(name, argv, self.log_dir, env)
        return service.start()

    def start_redis(self) -> None:
        self.redis.start()

    def start_observer(self) -> Observer:
        self.observer = Observer(self.ipc("observer"))
        return self.observer

    def start_cache_index(self) -> Service:
        return self.add("cache_index", ["services.cache_index", "--cache-index-addr", self.cache_index_addr,
                                        "--redis-url", self.redis.url, "--retry-interval-s", "0.2",
                                        "--redis-timeout-s", "0.5"])

    def start_scheduler(self, *extra: str, index: int = 0) -> Service:
        name = scheduler_name(index)
        return self.add(name, ["services.scheduler", "--scheduler-addr", self.ipc(name),
                               "--redis-url", self.redis.url, "--cache-index-addr", self.cache_index_addr,
                               "--heartbeat-timeout-s", "1.0", "--redis-retry-s", "0.5", *extra])

    def start_worker(self, index: int, *extra: str) -> Service:
        schedulers = self.scheduler_addrs + ([self.observer.addr] if self.observer else [])
        return self.add(f"worker{index}", [
            "services.gpu_worker", "--worker-id", f"worker{index}", "--worker-addr", self.ipc(f"worker{index}"),
            "--scheduler-addrs", ",".join(schedulers), "--cache-index-addr", self.cache_index_addr,
            "--model", MODEL, "--device", "cpu", "--num-pages", "256", "--heartbeat-interval-s", "0.2", *extra],
            env={"OMP_NUM_THREADS": "1"})

    def start_tokenizer(self, index: int) -> Service:
        return self.add(f"tokenizer{index}", [
            "services.tokenizer", "--model", MODEL, "--tokenizer-addr", self.ipc(f"tokenizer{index}"),
            "--stream-addr", self.ipc(f"tokenizer{index}-stream"), "--scheduler-addrs", ",".join(self.scheduler_addrs)])

    def start_gateway(self, num_tokenizers: int, *extra: str, name: str = "gateway") -> tuple[Service, str]:
        port = free_port()
        if name == "gateway":
            self.gateway_port = port
        tokenizers = ",".join(self.ipc(f"tokenizer{i}") for i in range(num_tokenizers))
        service = self.add(name, ["services.gateway", "--host", "127.0.0.1", "--port", str(port),
                                  "--tokenizer-addrs", tokenizers, "--scheduler-addrs", ",".join(self.scheduler_addrs),
                                  *extra])
        return service, f"http://127.0.0.1:{port}"

    def wait_workers(self, num_workers: int, timeout_s: float = 60.0) -> None:
        """Until every scheduler knows num_workers workers."""
        def ready() -> bool:
            statuses = [scheduler_status(addr, 0.5) for addr in self.scheduler_addrs]
            return all(s is not None and s.num_workers == num_workers for s in statuses)
        self._wait(ready, timeout_s)

    def wait_http(self, url: str, timeout_s: float = 60.0) -> None:
        self._wait(lambda: http_status(url + "/health") == 200, timeout_s)

    def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        try:
            wait_until(predicate, timeout_s, 0.1)
        except TimeoutError:
            dead = {name: s.proc.returncode for name, s in self.services.items() if not s.is_alive}
            raise TimeoutError(f"cluster not ready; dead services: {dead}; logs in {self.log_dir}") from None

    def dead_services(self) -> list[str]:
        return sorted(name for name, s in self.services.items() if not s.is_alive)

    def close(self) -> None:
        for service in self.services.values():  # SIGTERM to all first: they stop in parallel
            if service.is_alive:
                service.proc.send_signal(signal.SIGTERM)
        for service in reversed(list(self.services.values())):
            service.stop()
        if self.observer is not None:
            self.observer.close()
        self.redis.stop()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def scheduler_name(index: int) -> str:
    return "scheduler" if index == 0 else f"scheduler{index}"


def completion(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A /v1/completions body with a token-id prompt (random models have no tokenizer)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}
