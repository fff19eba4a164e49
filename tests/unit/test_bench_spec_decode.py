"""bench.spec_decode's replay mode on a tiny random model on the CPU: outputs identical to the plain engine's record,
acceptance exact at alpha 1 and 0, and the report's fields."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import spec_decode


def test_replay_mode_reports_exact_acceptance_at_alpha_one_and_zero(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    result = spec_decode.main(["--device", "cpu", "--model", "random:tiny-llama", "--proposer", "replay",
                               "--alpha", "1", "0", "--k", "4", "--num-prompts", "2", "--prompt-tokens", "16",
                               "--max-tokens", "24", "--rounds", "1", "--num-pages", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert (result["device"], result["gpu"], result["k"], list(result["batches"])) == ("cpu", None, 4, ["2"])
    assert result["commit"] and result["torch"] and result["verify_graph_buckets"] is None  # no CUDA graphs
    assert result["batches"]["2"]["num_prompts"] == 2  # --batches defaults to --num-prompts
    every, none = result["batches"]["2"]["alphas"]["1.0"], result["batches"]["2"]["alphas"]["0.0"]
    for run in (every, none):
        assert run["is_identical"] and run["is_plain_identical"]
        assert run["output_tokens"] == [24, 24] and run["common_prefix_tokens"] == [24, 24]
        assert [len(t) for t in run["tpot_ms"].values()] == [2, 2]
        assert run["median_spec_tpot_common_prefix_ms"] == run["median_tpot_ms"]["spec"]  # identical: every token
        assert run["tpot_ratio"] == pytest.approx(run["median_tpot_ms"]["spec"] / run["median_tpot_ms"]["plain"],
                                                  abs=2e-3)
    assert every["spec_decode"]["acceptance_rate"] == 1.0 and every["replay"]["true_draft_rate"] == 1.0
    assert every["spec_decode"]["num_accepted_tokens"] == every["spec_decode"]["num_draft_tokens"] > 0
    assert every["spec_decode"]["mean_accepted_length"] > 4  # k + 1 per verified row, fewer only near max_tokens
    assert every["tokens_per_verify"] == {"expected": 5.0, "measured": every["spec_decode"]["mean_accepted_length"]}
    assert none["tokens_per_verify"] == {"expected": 1.0, "measured": 1.0}
    assert every["verify_graph_replays"] is None and none["verify_graph_replays"] is None
    assert none["spec_decode"]["num_draft_tokens"] > 0 and none["spec_decode"]["num_accepted_tokens"] == 0
    assert none["replay"]["true_draft_rate"] == 0.0


def test_tpot_leaves_prefill_out_and_may_stop_at_a_prefix() -> None:
    stamps = [10.0, 10.5, 11.0, 11.0, 13.0]
    assert spec_decode.tpot(stamps) == 3.0 / 4
    assert spec_decode.tpot(stamps, 3) == 1.0 / 2
    assert spec_decode.tpot([4.0]) == 0.0


def test_batches_decode_together_keyed_by_batch_then_alpha() -> None:
    result = spec_decode.main(["--device", "cpu", "--model", "random:tiny-llama", "--proposer", "replay",
                               "--alpha", "1", "--k", "3", "--prompt-tokens", "8", "--max-tokens", "12",
                               "--rounds", "1", "--num-pages", "64", "--batches", "1", "3"])
    assert list(result["batches"]) == ["1", "3"]
    for size in (1, 3):
        run = result["batches"][str(size)]["alphas"]["1.0"]
        assert run["is_identical"] and run["output_tokens"] == [12] * size
        assert [len(t) for t in run["tpot_ms"].values()] == [size, size]
        assert run["tokens_per_verify"]["expected"] == 4.0


def test_expected_tokens_per_verify() -> None:
    assert spec_decode.expected_tokens_per_verify(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert spec_decode.expected_tokens_per_verify(0.0, 4) == 1.0
    assert spec_decode.expected_tokens_per_verify(1.0, 4) == 5.0


def test_replay_makes_the_random_greedy_output_robust():
    """Only the residual branches' output projections are scaled; the LM head becomes the embedding."""
    import torch

    from bench.spec_decode import make_greedy_robust

    names = ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    state = {name: torch.ones(2, 2) for name in names}
    state |= {"model.embed_tokens.weight": torch.full((3, 2), 7.0), "lm_head.weight": torch.zeros(3, 2)}
    make_greedy_robust(state, 1e-3)
    assert [float(state[n][0, 0]) for n in names] == pytest.approx([1e-3, 1e-3, 1.0, 1.0])
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
