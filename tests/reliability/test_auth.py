"""Who can reach what: `radixserve serve --api-key` closes everything but /health to callers without one of
the keys, and the internal ZeroMQ sockets are reachable only on this machine (ipc:// under `serve`, loopback by
default for every service)."""
from __future__ import annotations

import dataclasses
import hmac
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from services.cache_index.config import CacheIndexConfig
from services.gateway import service as gateway_service
from services.gateway.protocol import ApiError
from services.gpu_worker.config import WorkerConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from tests.reliability.cluster import MODEL, completion, free_port, http_status, wait_until

KEYS = ("sk-first-0123456789", "sk-second")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    log = open(tmp_path_factory.mktemp("auth") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model", MODEL, "--device", "cpu",
                             "--port", str(port), "--num-pages", "256", "--api-key", KEYS[0], "--api-key", KEYS[1]],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or http_status(url + "/health") == 200, 90, 0.2)
        assert proc.poll() is None
        yield proc, url
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        log.close()


def call(url: str, method: str, path: str, authorization: str | bytes | None = None) -> requests.Response:
    headers = {} if authorization is None else {"Authorization": authorization}
    body = completion(MODEL, [5, 6, 7], 2) if method == "POST" else None
    return requests.request(method, url + path, json=body, headers=headers, timeout=30)


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", f"/v1/models/{MODEL}"), ("GET", "/metrics"), ("GET", "/no/such/path"), ("DELETE", "/v1/models"),
          ("POST", "/tokenize"), ("POST", "/detokenize")]


@pytest.mark.slow
@pytest.mark.parametrize("method, path", ROUTES)
@pytest.mark.parametrize("authorization, code", [
    (None, "missing_api_key"), ("", "missing_api_key"), ("Bearer", "missing_api_key"), ("Bearer ", "missing_api_key"),
    (f"Basic {KEYS[0]}", "missing_api_key"), ("Bearer sk-wrong", "invalid_api_key"),
    (f"Bearer {KEYS[0]}x", "invalid_api_key"), (f"Bearer {KEYS[0][:-1]}", "invalid_api_key"),
    (f"Bearer {KEYS[0]},{KEYS[1]}", "invalid_api_key"), (b"Bearer \xff\xfe\x80", "invalid_api_key"),
    ("Bearer sk-\u00e9t\u00e9", "invalid_api_key")])
def test_everything_but_health_needs_a_key(served: tuple[subprocess.Popen, str], method: str, path: str,
                                           authorization: str | bytes | None, code: str) -> None:
    _, url = served
    resp = call(url, method, path, authorization)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == code


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_each_key_opens_every_route(served: tuple[subprocess.Popen, str], key: str) -> None:
    _, url = served
    for scheme in ("Bearer", "bearer"):
        statuses = [call(url, method, path, f"{scheme} {key}").status_code for method, path in ROUTES]
        # chat: the random model has no chat template; (de)tokenize: a completion body is not theirs
        assert statuses == [200, 400, 200, 200, 200, 404, 405, 400, 400]
    assert call(url, "GET", "/health").status_code == 200  # open without a key


@pytest.mark.slow
def test_serve_binds_only_ipc_and_loopback_http(served: tuple[subprocess.Popen, str]) -> None:
    proc, url = served
    port = int(url.rsplit(":", 1)[1])
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 6  # cache_index, scheduler, worker, tokenizer, gateway, the supervised redis-server
    assert [c.name() for c in children].count("redis-server") == 1
    listening = [(c.name(), conn.laddr) for c in children for conn in c.net_connections(kind="inet")
                 if conn.status == psutil.CONN_LISTEN]
    assert [(addr.ip, addr.port) for _, addr in listening] == [("127.0.0.1", port)]  # the gateway's HTTP only
    for child in children:
        assert not any("tcp://" in arg for arg in child.cmdline()), child.cmdline()


def test_every_internal_socket_defaults_to_loopback() -> None:
    addrs = {"tokenizer": [TokenizerConfig().tokenizer_addr, TokenizerConfig().stream_addr],
             "scheduler": [SchedulerConfig().scheduler_addr], "gpu_worker": [WorkerConfig().worker_addr],
             "cache_index": [CacheIndexConfig().cache_index_addr]}
    for service, bound in addrs.items():
        assert all(a.startswith("tcp://127.0.0.1:") for a in bound), (service, bound)
    assert SchedulerConfig().metrics_port == 0  # the scheduler's HTTP /metrics is off unless asked for


def test_key_check_compares_against_every_key_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[int, int]] = []
    compare_digest = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return compare_digest(a, b)

    monkeypatch.setattr(gateway_service.hmac, "compare_digest", spy)
    keys = [k.encode() for k in ("a", "a-much-longer-key", "k3")]
    gateway_service.check_bearer("Bearer a", keys)  # matches the first key, still compares all three
    assert compared == [(32, 32)] * 3  # digests: the time depends on neither length nor content
    with pytest.raises(ApiError) as err:
        gateway_service.check_bearer("Bearer a-much-longer", keys)
    assert err.value.status == 401


def test_gateway_config_has_no_default_key() -> None:
    from services.gateway.config import GatewayConfig

    assert GatewayConfig().api_key_list == []
    assert dataclasses.replace(GatewayConfig(), api_keys=" a , b ,").api_key_list == ["a", "b"]
