"""The GPU benchmark scripts' pure helpers, on the CPU (the scripts themselves need an H200: a broken helper
would otherwise surface only inside a device call, as `time_gpu`'s misnamed do_bench once did)."""
from __future__ import annotations

import pytest
import triton.testing

from bench import gpu_suite, timing


def test_time_gpu_is_do_bench_median_in_seconds(monkeypatch):
    calls = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        calls.append((warmup, rep, return_mode))
        fn()
        return 2.5  # ms

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    ran = []
    assert timing.time_gpu(lambda: ran.append(1), warmup=3, rep=7) == pytest.approx(2.5e-3)
    assert calls == [(3, 7, "median")] and ran == [1]


def test_summarise_steps_against_the_roofline():
    copy_tbs = 4.0
    # (batch, Σ seq_len, seconds): roofline = (16.06 GB + kv · 131,072 B) / 4 TB/s
    steps = [(1, 0, 2 * 16.06e9 / 4e12), (2, 1000, 3 * (16.06e9 + 1000 * 131072) / 4e12)]
    out = gpu_suite.summarise_steps(steps, copy_tbs)
    assert out["num_decode_steps"] == 2 and out["max_batch"] == 2
    assert out["median_step_over_roofline"] == pytest.approx(2.5)
    assert gpu_suite.summarise_steps([], copy_tbs) == {}
