"""Graceful shutdown of `radixserve serve`: SIGTERM drains the requests in flight (new ones get 503), and a
request that outlives the drain deadline is answered with 503, never left hanging; then serve exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.reliability.cluster import MODEL, completion, free_port, http_status, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def serve(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model", MODEL, "--device", "cpu",
                             "--port", str(port), "--num-pages", "512", *extra], stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: proc.poll() is not None or http_status(url + "/health") == 200, 90, 0.2)
    assert proc.poll() is None, (tmp_path / "serve.log").read_text()
    return proc, url


def in_flight(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("radixserve_gateway_requests_in_flight ")))


def post(url: str, body: dict) -> requests.Response:
    return requests.post(url + "/v1/completions", json=body, timeout=60)


def test_sigterm_drains_in_flight_requests_and_answers_the_rest_at_the_deadline(tmp_path: Path) -> None:
    drain_timeout_s = 8.0
    proc, url = serve(tmp_path, "--drain-timeout", str(drain_timeout_s))
    try:
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(post, url, completion(MODEL, [5 + i, 6, 7, 8], 200)) for i in range(4)]
            endless = pool.submit(post, url, completion(MODEL, [4, 5, 6], 100_000))  # until the context is full
            wait_until(lambda: in_flight(url) == 5, 10)
            proc.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            wait_until(lambda: http_status(url + "/health") in (0, 503), 5)
            late = post(url, completion(MODEL, [9, 9, 9], 4))
            assert late.status_code == 503  # refused while draining, with a hint to retry elsewhere
            assert late.headers["Retry-After"] == "1"
            replies = [f.result(timeout=60) for f in futures]
            cut_off = endless.result(timeout=60)
        assert [r.status_code for r in replies] == [200] * 4  # drained: finished in full
        assert [r.json()["usage"]["completion_tokens"] for r in replies] == [200] * 4
        assert cut_off.status_code == 503  # answered at the drain deadline, not left hanging
        assert "shut down" in cut_off.json()["error"]["message"]
        assert proc.wait(30) == 0
        assert drain_timeout_s <= time.monotonic() - stopped_at < drain_timeout_s + 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
