"""radixserve.probe, the Kubernetes exec probes: the health-file check's age and state, the wildcard address a
probe connects to, the HTTP check's status rule, and wait-closed's two outcomes."""
from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from pathlib import Path

from radixserve.probe import check_file, check_http, check_scheduler, connectable, main, wait_closed


def test_health_file_passes_when_fresh_and_in_the_asked_state(tmp_path: Path) -> None:
    path = tmp_path / "health"
    assert check_file(str(path), 10.0, None).startswith("no health file")
    path.write_text("serving")
    assert check_file(str(path), 10.0, None) is None
    assert check_file(str(path), 10.0, "serving") is None
    path.write_text("draining")
    assert check_file(str(path), 10.0, "serving") == f"{path} says 'draining', not 'serving'"
    assert check_file(str(path), 10.0, None) is None  # alive while draining
    old_s = time.time() - 31
    os.utime(path, (old_s, old_s))
    assert check_file(str(path), 30.0, None).startswith(f"{path} is 31")
    assert main(["file", str(path), "--max-age-s", "30"]) == 1


def test_a_wildcard_bind_is_probed_on_loopback() -> None:
    assert connectable("tcp://0.0.0.0:5560") == "tcp://127.0.0.1:5560"
    assert connectable("tcp://*:5560") == "tcp://127.0.0.1:5560"
    assert connectable("tcp://10.1.2.3:5560") == "tcp://10.1.2.3:5560"


def test_http_check_wants_200_unless_any_answer_will_do() -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert check_http(base + "/ok", 2.0, False) is None
        assert check_http(base + "/health", 2.0, False) == f"{base}/health answered 503"
        assert check_http(base + "/health", 2.0, True) is None
    finally:
        server.shutdown()
        server.server_close()
    assert check_http(base + "/health", 2.0, True).startswith("no answer")


def test_wait_closed_returns_once_nothing_listens() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    assert wait_closed(url, 0.6) == f"{url} still accepts connections after 0.6 s"
    listener.close()
    assert wait_closed(url, 5.0) is None


def test_a_silent_scheduler_fails_the_probe() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    assert check_scheduler(f"tcp://127.0.0.1:{port}", 0.2) == f"scheduler at tcp://127.0.0.1:{port} did not answer " \
                                                               "within 0.2 s"
