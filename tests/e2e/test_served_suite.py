"""bench.served_suite end to end on the CPU: a real `radixserve serve` (bundled model), W1 and W6 scaled down."""
from __future__ import annotations

import json
import os

import pytest

from bench import served_suite

pytestmark = pytest.mark.slow


def test_served_suite_accounts_for_every_request(tmp_path):
    argv = ["--phases", "w1,w6", "--serve-args", "--device cpu", "--out-dir", str(tmp_path),
            "--scale", "0.008", "--w1-input-len", "16", "--w1-output-len", "8",
            "--w6-duration-s", "6", "--w6-concurrency", "4", "--w6-sample-interval-s", "1",
            "--w6-prefix-len", "32", "--w6-num-prefixes", "4", "--w6-input-len", "16", "--w6-output-len", "8"]
    assert served_suite.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    server = summary["servers"]["default"]
    assert server["exit_code"] == 0 and server["command"].endswith(" --device cpu")
    assert server["model"] == "smollm2-135m-instruct" and list(summary["servers"]) == ["default"]
    assert len(summary["commit"]) == 12 and summary["hardware"]["cpu_count"] == os.cpu_count()  # others commit
    assert summary["vocab_size"] == 32000 and summary["command"].startswith("python -m bench.served_suite --phases")

    w1 = summary["phases"]["w1"]
    assert (w1["rc"], w1["num_sent"], w1["num_ok"], w1["failed_by_kind"]) == (0, 8, 8, {})
    assert w1["num_completion_tokens"] == w1["num_expected_tokens"] == 64
    assert w1["finish_reasons"] == {"length": 8} and w1["is_exact"] is True

    w6 = summary["phases"]["w6"]
    assert w6["rc"] == 0 and w6["num_failed"] == 0 and w6["num_sent"] >= 4 and w6["is_exact"] is True
    assert w6["num_completion_tokens"] == w6["num_expected_tokens"]
    assert w6["finish_reasons"] == {"length": w6["num_sent"]}
    run = json.loads((tmp_path / "w6.json").read_text())["runs"][0]
    assert run["totals"]["num_sent"] == w6["num_sent"] and len(run["samples"]) == 6
    assert sum(s["num_output_tokens"] for s in run["samples"]) <= w6["num_completion_tokens"]
    assert run["sustained"]["concurrency"] == 4 and run["sustained"]["steady_num_samples"] == 1
    w1_record = json.loads((tmp_path / "w1.json").read_text())
    assert w1_record["served_suite"]["serve_command"] == server["command"]
    assert w1_record["command"].startswith("radixserve bench --base-url http://127.0.0.1:")
    assert len(w1_record["runs"][0]["requests"]) == 8
    assert all("itl_s" not in r and r["finish_reason"] == "length" for r in w1_record["runs"][0]["requests"])
    assert (tmp_path / "serve_default.log").stat().st_size > 0 and (tmp_path / "w6_timeline.png").exists()
