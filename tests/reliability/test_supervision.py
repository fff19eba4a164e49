"""Issue 31, item 4: `serve` supervises its children as an orchestrator would. Before, any one process dying was a
full outage: serve stopped everything; a killed worker ended its streams with a null-coded error and no [DONE], and
a killed tokenizer froze its streams. Now a dead child (each service, and the embedded Redis) is started again
after a backoff, the server answers again, and a stream that lost its worker or its tokenizer ends with a coded
error event and [DONE] (the gateway asks the tokenizers which requests they hold: services/gateway/tokenizer_watch.py).

One real `serve` (random tiny weights, CPU). For each process in turn, a burst of streaming requests is sent, the
process is killed with SIGKILL during it, and then: every request of the burst ended (all its tokens, or an error
that says so: an HTTP error status, or an error event followed by [DONE]), serve logged the restart, and a new
request is answered in full."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import free_port, stop, wait_healthy
from tests.reliability.cluster import MODEL, ROOT, completion, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BURST = 24
MAX_TOKENS = 400


def child_pids(parent: int) -> dict[str, int]:
    """Each direct child of parent: its service module (or "redis") → pid, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != parent:
            continue
        if b"-m" in argv:
            found[argv[argv.index(b"-m") + 1].decode()] = int(entry.name)
        elif argv and b"redis-server" in argv[0]:  # NOTE: redis rewrites its title: ".../redis-server unixsocket:..."
            found["redis"] = int(entry.name)
    return found


def run_stream(url: str, prompt: list[int], results: list[str]) -> None:
    """One streaming completion; appends "ok" (all MAX_TOKENS tokens and [DONE]), "error" (an HTTP error, or an
    error event and then [DONE]) or what went wrong."""
    try:
        with requests.post(f"{url}/v1/completions", json={**completion(MODEL, prompt, MAX_TOKENS), "stream": True},
                           stream=True, timeout=90) as resp:
            if resp.status_code != 200:
                results.append("error")
                return
            num_tokens, saw_error = 0, False
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    results.append("error" if saw_error else "ok" if num_tokens == MAX_TOKENS else f"short {num_tokens}")
                    return
                event = json.loads(data)
                if "error" in event:
                    saw_error = True
                elif event.get("choices"):
                    num_tokens += 1
            results.append("cut")  # the stream ended without [DONE]
    except requests.RequestException as exc:
        results.append(f"exception {type(exc).__name__}")


@pytest.fixture
def serve(tmp_path: Path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--model", MODEL,
                             "--device", "cpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=120)
        # serve itself saw the start-up end (a child dying before that ends serve: a start-up failure repeats)
        wait_until(lambda: "radixserve ready" in (tmp_path / "serve.log").read_text(), timeout_s=10)
        yield proc, url, tmp_path / "serve.log"
    finally:
        assert stop(proc) == 0
        log.close()


@pytest.mark.parametrize("order", [("services.gpu_worker", "redis", "services.cache_index", "services.scheduler",
                                    "services.tokenizer", "services.gateway")])
def test_each_process_killed_during_a_burst_comes_back_and_nothing_hangs(serve, order) -> None:
    proc, url, log_path = serve
    for round_index, name in enumerate(order):
        pids = child_pids(proc.pid)
        assert name in pids, pids
        results: list[str] = []
        threads = [threading.Thread(target=run_stream, args=(url, [10 + (round_index * 31 + i * 7 + j) % 400
                                                                   for j in range(48)], results))
                   for i in range(BURST)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # the burst is in flight
        os.kill(pids[name], signal.SIGKILL)
        for thread in threads:
            thread.join(100)
        assert len(results) == BURST, f"{name}: {BURST - len(results)} requests still hanging"
        # the gateway holds the clients' connections: killing it breaks them (at once, not a hang); every other
        # process's death ends each stream with its tokens, or a coded error event and [DONE]
        allowed = {"ok", "error"} | ({"exception ChunkedEncodingError", "exception ConnectionError"}
                                     if name == "services.gateway" else set())
        unclean = [r for r in results if r not in allowed]
        assert not unclean, f"{name}: {unclean}"
        new_pid = wait_until(lambda: child_pids(proc.pid).get(name) not in (None, pids[name])
                             and child_pids(proc.pid)[name], timeout_s=30)
        assert f"restarted (pid {new_pid})" in log_path.read_text()
        after: list[str] = []
        wait_until(lambda: run_stream(url, [5, 6, 7, 8], after) or after[-1] == "ok", timeout_s=60, interval_s=0.5)
