"""bench.served_suite's pieces: phase grouping, the bench command of each phase, the vocabulary, stopping serve."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import served_suite


def test_phases_share_servers_by_their_serve_arguments():
    args = served_suite.parse_args(["--phases", "w1,w1-nocache,w0,w6"])
    assert args.phase_list == ["w1", "w1-nocache", "w0", "w6"]
    assert [served_suite.PHASES[p][0] for p in args.phase_list] == ["default", "nocache", "default", "default"]
    assert served_suite.GROUP_SERVE_ARGS["nocache"] == ["--no-prefix-cache"]
    assert served_suite.GROUP_SERVE_ARGS["fp8"] == ["--quantization", "fp8"]
    assert served_suite.PHASES["b1-fp8"] == ("fp8", "b1", 3) and served_suite.PHASES["w0-awq"] == ("awq", "w0", 1)
    with pytest.raises(SystemExit):
        served_suite.parse_args(["--phases", "w1,w9"])


def test_bench_argv_scales_counts_and_pairs_seeds():
    args = served_suite.parse_args(["--scale", "0.01", "--seed", "5", "--w6-concurrency", "512",
                                    "--w6-duration-s", "600"])
    w1 = served_suite.bench_argv("w1", args, "http://h:1", 128256, Path("out"))
    assert w1 == ["bench", "--base-url", "http://h:1", "--workload", "w1", "--vocab-size", "128256", "--seed", "5",
                  "--timeout-s", "1800", "--out-dir", "out", "--name", "w1", "--request-detail", "compact",
                  "--rate", "inf", "--num-requests", "10", "--input-len", "1000", "--output-len", "1000",
                  "--no-progress"]
    w0 = served_suite.bench_argv("w0", args, "http://h:1", 128256, Path("out"))
    assert w0[w0.index("--num-requests") + 1] == "1" and w0[w0.index("--seed") + 1] == "6"
    nocache = served_suite.bench_argv("w1-nocache", args, "http://h:1", 128256, Path("out"))
    assert nocache == [*w1[:14], "w1-nocache", *w1[15:]]  # the same requests as w1's, under its own name
    w6 = served_suite.bench_argv("w6-nocache", args, "http://h:1", 128256, Path("out"))
    assert w6[w6.index("--concurrency") + 1] == "512" and w6[w6.index("--duration-s") + 1] == "600"
    assert w6[w6.index("--request-detail") + 1] == "none" and w6[w6.index("--prefix-len") + 1] == "1024"
    assert w6[w6.index("--seed") + 1] == "7"
    b1 = served_suite.bench_argv("b1-fp8", args, "http://h:1", 128256, Path("out"))  # W0's shape, one at a time
    assert b1[b1.index("--workload") + 1] == "w0" and b1[b1.index("--concurrency") + 1] == "1"
    assert b1[b1.index("--num-requests") + 1] == "4" and b1[b1.index("--output-len") + 1] == "256"
    assert b1[b1.index("--name") + 1] == "b1-fp8"


def test_vocab_size_follows_the_served_model():
    assert served_suite.vocab_size(["--model", "random:llama3-8b", "--device", "cuda"], None) == 128256
    assert served_suite.vocab_size([], None) == 32000
    assert served_suite.vocab_size(["--model", "random:llama3-8b"], 5000) == 5000


def _child(on_sigint: str) -> subprocess.Popen:
    code = (f"import signal, sys, time; signal.signal(signal.SIGINT, {on_sigint}); print('up', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    proc.stdout.close()
    return proc


def test_stop_sends_sigint_then_escalates_to_sigterm():
    assert served_suite.stop(_child("lambda *_: sys.exit(0)"), timeout_s=30) == 0
    assert served_suite.stop(_child("signal.SIG_IGN"), timeout_s=0.5) == -signal.SIGTERM
