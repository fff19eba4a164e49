"""Mixtral and Qwen3-MoE from tiny transformers checkpoints: per-expert tensors stacked on load, the config
mapping, the router's normalisation, and the engine's greedy tokens equal transformers' fp32 greedy generate()."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers

from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.loader import LoadedModel, config_from_hf, load_model
from services.gpu_worker.model.moe import Experts
from tests.unit.hf_checkpoints import engine_tokens, greedy_both_ways, hf_generate, random_prompts, save_checkpoint
from tests.unit.step_modes import step_mode  # noqa: F401 - step_mode: autouse, both modes

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               initializer_range=0.1, num_experts_per_tok=2)
TINY = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(num_local_experts=6)),
    # layer 1 keeps a dense MLP (mlp_only_layers); norm_topk_prob on, as in Qwen3-30B-A3B
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=6, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
}


@functools.cache
def _checkpoint(root: str, family: str) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny random model of the family, saved as transformers saves it (one tensor per expert)."""
    config_class, model_class, extra = TINY[family]
    torch.manual_seed(0)
    return save_checkpoint(model_class(config_class(**_COMMON, **extra)), root, f"tiny-{family}")


@pytest.fixture(scope="module", params=list(TINY))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return _checkpoint(str(tmp_path_factory.getbasetemp()), request.param)


@pytest.mark.parametrize("max_num_batched_tokens", [None, 7])
def test_greedy_equals_transformers_generate(checkpoint, max_num_batched_tokens: int | None) -> None:
    got, want = greedy_both_ways(*checkpoint, _COMMON["vocab_size"], max_num_batched_tokens)
    assert got == want


def test_experts_are_stacked_on_load(checkpoint) -> None:
    path, hf = checkpoint
    loaded = load_model(str(path))
    cfg, sd = loaded.config, loaded.state_dict
    hf_sd = hf.state_dict()  # transformers 5 holds the experts fused in memory: gate_up_proj [E, 2 I, hidden]
    assert cfg.num_experts == 6 and cfg.num_experts_per_tok == 2
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert moe_layers == ([0, 1] if cfg.arch == "mixtral" else [0])
    for i in moe_layers:
        p = f"model.layers.{i}.mlp."
        assert sd[p + "experts.gate_up_proj"].shape == (6, 2 * cfg.moe_intermediate_size, 64)
        for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
            assert torch.equal(sd[p + name], hf_sd[p + name])
    if cfg.arch == "qwen3_moe":
        assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"], hf_sd["model.layers.1.mlp.up_proj.weight"])


def test_a_checkpoint_in_the_fused_layout_loads_as_it_is(checkpoint, tmp_path: Path) -> None:
    """transformers 5's in-memory state dict (experts fused, Mixtral's block_sparse_moe renamed mlp) saved as is."""
    from safetensors.torch import save_file

    path, hf = checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    fused, per_expert = load_model(str(tmp_path)).state_dict, load_model(str(path)).state_dict
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in hf.state_dict())
    assert fused.keys() == per_expert.keys() and all(torch.equal(fused[n], per_expert[n]) for n in fused)


def test_router_normalisation_is_needed(checkpoint) -> None:
    """The family's top-k normalisation switched off: no longer transformers' tokens."""
    path, hf = checkpoint
    loaded = load_model(str(path))
    assert loaded.config.norm_topk_prob
    wrong = LoadedModel(loaded.config.with_(norm_topk_prob=False), loaded.state_dict, None, loaded.source_dir)
    prompts = random_prompts(_COMMON["vocab_size"])
    got = engine_tokens(wrong, prompts)
    assert sum(g != hf_generate(hf, p) for g, p in zip(got, prompts)) >= 2


def _naive_moe(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.stack([sum(weights[t, j] * experts.expert(int(ids[t, j]), x[t: t + 1])[0]
                            for j in range(ids.shape[1])) for t in range(x.shape[0])])


def test_grouped_path_equals_the_per_token_sum() -> None:
    torch.manual_seed(1)
    experts = Experts(num_experts=5, hidden_size=16, intermediate_size=8)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    x = torch.randn(9, 16)
    ids = torch.stack([torch.randperm(5)[:3] for _ in range(9)])  # [9, 3], experts 0..4, some never hit per token
    weights = torch.rand(9, 3)
    want = _naive_moe(experts, x, ids, weights)
    torch.testing.assert_close(experts._grouped(x, ids, weights), want, rtol=1e-5, atol=1e-6)


MIXTRAL_MIN = {"architectures": ["MixtralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 8}


def test_config_mapping_defaults() -> None:
    mixtral = config_from_hf(MIXTRAL_MIN, "m")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 96)
    assert (mixtral.norm_topk_prob, mixtral.rope_theta, mixtral.num_kv_heads, mixtral.qk_norm) == (True, 1e6, 8, False)
    assert mixtral.max_position_embeddings == 131072 and mixtral.dense_mlp_layers == ()
    windowed = config_from_hf({**MIXTRAL_MIN, "sliding_window": 4096}, "m")
    assert (windowed.max_position_embeddings, windowed.sliding_window_layers) == (131072, (0, 1, 2, 3))
    qwen = config_from_hf({**MIXTRAL_MIN, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16,
                           "decoder_sparse_step": 2, "mlp_only_layers": [3], "rope_theta": 1e6}, "m")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (16, 8, 768)
    assert (qwen.norm_topk_prob, qwen.qk_norm, qwen.rope_theta, qwen.num_kv_heads) == (False, True, 1e6, 4)
    assert qwen.dense_mlp_layers == (0, 2, 3)  # (i + 1) % step != 0, and mlp_only_layers


def test_unsupported_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="Qwen3-MoE: use_sliding_window=true is not supported"):
        config_from_hf({**MIXTRAL_MIN, "architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": True}, "m")
    with pytest.raises(ValueError, match="Mixtral: unsupported hidden_act 'gelu'"):
        config_from_hf({**MIXTRAL_MIN, "hidden_act": "gelu"}, "m")


class _FakeGroup:
    size, rank = 2, 0


def test_tensor_parallel_needs_an_even_share_of_each_expert() -> None:
    """Experts shard over the ranks (each its share of every expert's intermediate size): it must divide."""
    cfg = config_from_hf({**MIXTRAL_MIN, "intermediate_size": 97}, "tiny-mixtral")
    with pytest.raises(ValueError, match="does not divide tiny-mixtral's moe_intermediate_size=97"):
        LlamaForCausalLM(cfg, _FakeGroup())
    model = LlamaForCausalLM(config_from_hf(MIXTRAL_MIN, "tiny-mixtral"), _FakeGroup())
    assert model.model.layers[0].mlp.experts.down_proj.shape == (8, 64, 48)
