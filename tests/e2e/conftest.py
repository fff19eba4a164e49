"""Start real radixserve processes for end-to-end tests."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST body as JSON → (status, the JSON answer), error statuses included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def series_sum(text: str, name: str) -> float:
    """The sum of a metric's samples over its label sets (every worker's) in a Prometheus text scrape."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def scraped_sum(url: str, name: str) -> float:
    """series_sum of name in the server's /metrics now."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return series_sum(resp.read().decode(), name)


@contextlib.contextmanager
def serving(args: list[str], log_path: Path, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """`radixserve serve --port <free> *args` with its output in log_path; yields the base URL, and checks
    that it stops cleanly (exit code 0) afterwards."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, ready_timeout_s)
            yield url
        finally:
            assert stop(proc) == 0


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Iterator[str]:
    """`radixserve serve` on the bundled model with two workers; yields the base URL."""
    with serving(["--workers", "2", "--num-pages", "512", "--device", "cpu"],
                 tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(served: str) -> openai.OpenAI:
    """The openai SDK against `served`, with no retries."""
    return openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
