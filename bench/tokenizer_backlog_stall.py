"""By hand: how long a real tokenizer's event loop stalls on a backlog. A fake gateway sends --requests
GenerateRequests of --prompt-tokens token ids at once; a fake scheduler reads the TokenizedRequests. Prints the
tokenizer's max loop stall (from its `stopped` line) and how long the requests took to pass.

    .venv/bin/python -m bench.tokenizer_backlog_stall --requests 3000
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from shared.messages import GenerateRequest, encode
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rs-stall"))
    ctx = zmq.Context()
    scheduler = ctx.socket(zmq.ROUTER)
    scheduler.bind(f"ipc://{tmp}/scheduler")
    log_path = tmp / "tokenizer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.tokenizer", "--model", "random:tiny-llama", "--tokenizer-addr",
             f"ipc://{tmp}/tokenizer", "--stream-addr", f"ipc://{tmp}/stream", "--scheduler-addrs",
             f"ipc://{tmp}/scheduler"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "RADIXSERVE_LOG_JSON": "0"})
    gateway = ctx.socket(zmq.DEALER)
    gateway.setsockopt(zmq.SNDHWM, 0)
    gateway.connect(f"ipc://{tmp}/tokenizer")
    frames = [encode(GenerateRequest(f"r{i}", SamplingParams(max_tokens=2), prompt_token_ids=[
        3 + (i * 7 + j * 13) % 500 for j in range(args.prompt_tokens)])) for i in range(args.requests)]
    time.sleep(3)  # the tokenizer is up
    started = time.monotonic()
    for frame in frames:
        gateway.send(frame)
    num_passed = 0
    while num_passed < args.requests and time.monotonic() - started < 120 and scheduler.poll(5000):
        num_passed += b"TokenizedRequest" in scheduler.recv_multipart()[-1][:64]
    passed_s = time.monotonic() - started
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    stall = re.search(r"max_loop_stall_ms=(\d+)", log_path.read_text())
    print(f"{num_passed}/{args.requests} requests of {args.prompt_tokens} tokens passed in {passed_s:.2f} s; "
          f"tokenizer max loop stall {stall.group(1) if stall else '?'} ms")
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
