"""bench/pd_gpu.py (the H200 PD script): its arguments and budget planning, and its transfer phase on the CPU
with a tiny KV shape (this process exports a pool, a child process pulls it by shm and by stream)."""
from __future__ import annotations

import json

from bench import pd_gpu


def test_defaults_are_the_gpu_run_and_dry_run_scales_down() -> None:
    args = pd_gpu.parse_args(["--out", "x", "--device", "cuda"])
    assert (args.model, args.kv_model, args.kv_dtype) == ("random:llama3-8b", "random:llama3-8b", "bfloat16")
    assert pd_gpu.ints(args.transfer_lens) == [512, 2048, 8192, 32768]
    assert pd_gpu.transfer_backends(args) == ["cuda_ipc", "stream"]
    assert "--workers" in pd_gpu.deployment_args(args, "colocated")
    pd = pd_gpu.deployment_args(args, "pd")
    assert pd[pd.index("--pd") + 1] == "1:1" and pd[pd.index("--num-pages") + 1] == "4096"
    assert pd_gpu.num_workers(args, "pd") == 2
    dry = pd_gpu.parse_args(["--cpu-dry-run", "--w4-rates", "2"])
    assert (dry.device, dry.model, dry.w4_rates) == ("cpu", "random:smollm2-135m", "2")
    assert pd_gpu.transfer_backends(dry) == ["shm", "stream"]


def test_fit_plan_drops_rates_from_the_end_until_both_deployments_fit() -> None:
    pairs = [(1.0, 50), (8.0, 240)]
    assert pd_gpu.fit_plan(pairs, 2, 1000, 75) == pairs
    assert pd_gpu.fit_plan(pairs, 2, 400, 75) == [(1.0, 50)]
    assert pd_gpu.fit_plan(pairs, 2, 100, 75) == []


def test_transfer_phase_on_cpu_moves_and_verifies_every_page(tmp_path) -> None:
    args = pd_gpu.parse_args(["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--device",
                              "cpu", "--kv-model", "random:tiny-llama", "--transfer-lens", "40,160",
                              "--transfer-repeats", "2", "--stream-repeats", "2", "--time-budget-s", "120"])
    rec = pd_gpu.Record(args, [])
    result = pd_gpu.run_transfer(args, rec)
    assert "error" not in result, result
    per_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head_dim 16, bf16
    assert result["bytes_per_token"] == per_token
    for backend in ("shm", "stream"):
        rows = result["backends"][backend]
        assert rows["open"]["first_pull_s"] > 0
        for tokens, pages in ((40, 3), (160, 10)):
            row = rows[str(tokens)]
            assert row["bytes"] == pages * 16 * per_token and len(row["seconds"]) == 2
            assert row["verified"] is True and row["gb_s"] > 0
    rec.save(pack=True)
    assert json.loads((tmp_path / "out" / pd_gpu.RESULT_NAME).read_text())["settings"]["device"] == "cpu"


def test_fit_runs_keeps_the_first_rate_when_start_up_ran_long() -> None:
    todo = [(1.0, 40), (8.0, 200)]
    assert pd_gpu.fit_runs(todo, 400, 1, 75) == todo
    assert pd_gpu.fit_runs(todo, 300, 1, 75) == [(1.0, 40)]
    assert pd_gpu.fit_runs(todo, 200, 0, 75) == todo
