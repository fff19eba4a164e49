"""`python -m radixserve.probe CHECK`: the Kubernetes probes (exec) that a port alone cannot answer; exit 0 passes.

    http URL [--any-status]     GET URL answers 200 (--any-status: any HTTP answer; a wedged event loop gives none)
    scheduler [--addr ADDR]     the scheduler answers a StatusRequest (default ADDR: RADIXSERVE_SCHEDULER_ADDR)
    file PATH [--state S]       PATH was rewritten within --max-age-s (the worker's health_file), holding S if given
    wait-closed URL             wait until nothing accepts connections at URL's host:port, or --timeout-s passed
                                (a preStop hook: a pod's tokenizer outlives its gateway's drain)

Imports no torch and no service: a probe runs every few seconds beside the service it checks.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_SCHEDULER_ADDR = "tcp://127.0.0.1:5560"


def check_http(url: str, timeout_s: float, is_any_status: bool) -> str | None:
    """None when url answers 200 (or anything, with is_any_status), else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status = resp.status
    except urllib.error.HTTPError as err:
        status = err.code
    except OSError as exc:
        return f"no answer from {url}: {exc}"
    return None if status == 200 or is_any_status else f"{url} answered {status}"


def check_scheduler(addr: str, timeout_s: float) -> str | None:
    """None when the scheduler at addr answers a StatusRequest within timeout_s (its event loop runs)."""
    import zmq

    from shared.messages import StatusReply, StatusRequest, decode, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(connectable(addr))
        sock.send(encode(StatusRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            return f"scheduler at {addr} did not answer within {timeout_s:g} s"
        reply = decode(sock.recv_multipart()[-1], StatusReply)
        print(f"scheduler ok: {reply.num_workers} workers, {reply.num_queued} queued, {reply.num_in_flight} in flight")
        return None
    finally:
        sock.close()
        ctx.term()


def check_file(path: str, max_age_s: float, state: str | None) -> str | None:
    """None when path was rewritten within max_age_s and holds state (when given)."""
    try:
        age_s = time.time() - os.stat(path).st_mtime
        text = open(path).read().strip()
    except OSError as exc:
        return f"no health file: {exc}"
    if age_s > max_age_s:
        return f"{path} is {age_s:.1f} s old (limit {max_age_s:g} s)"
    if state is not None and text != state:
        return f"{path} says {text!r}, not {state!r}"
    return None


def wait_closed(url: str, timeout_s: float) -> str | None:
    """None once nothing accepts a connection at url's host and port; a message if it still does at timeout_s."""
    parts = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((parts.hostname, parts.port or 80), timeout=1.0).close()
        except OSError:
            return None
        time.sleep(0.5)
    return f"{url} still accepts connections after {timeout_s:g} s"


def connectable(addr: str) -> str:
    """A bind address as a peer in the same network namespace reaches it (a wildcard host is this machine)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if addr.startswith(wildcard):
            return "tcp://127.0.0.1:" + addr[len(wildcard):]
    return addr


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m radixserve.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-s", type=float, default=3.0, help="longest wait for an answer")
    checks = parser.add_subparsers(dest="check", required=True)
    http = checks.add_parser("http")
    http.add_argument("url")
    http.add_argument("--any-status", action="store_true")
    scheduler = checks.add_parser("scheduler")
    scheduler.add_argument("--addr", default=os.environ.get("RADIXSERVE_SCHEDULER_ADDR", DEFAULT_SCHEDULER_ADDR))
    health = checks.add_parser("file")
    health.add_argument("path")
    health.add_argument("--max-age-s", type=float, default=10.0)
    health.add_argument("--state", default=None)
    closed = checks.add_parser("wait-closed")
    closed.add_argument("url")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check == "http":
        failure = check_http(args.url, args.timeout_s, args.any_status)
    elif args.check == "scheduler":
        failure = check_scheduler(args.addr, args.timeout_s)
    elif args.check == "file":
        failure = check_file(args.path, args.max_age_s, args.state)
    else:
        failure = wait_closed(args.url, args.timeout_s)
    if failure is not None:
        print(failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
