"""Phi-3 from a tiny transformers checkpoint: its fused qkv/gate_up tensors split on load, its config mapping,
and the engine's greedy tokens equal transformers' fp32 greedy generate()."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers

from services.gpu_worker.model.loader import LoadedModel, config_from_hf, load_model
from services.gpu_worker.model.phi3 import checkpoint_shapes
from tests.unit.hf_checkpoints import engine_tokens, greedy_both_ways, hf_generate, random_prompts, save_checkpoint
from tests.unit.step_modes import step_mode  # noqa: F401 - step_mode: autouse, both modes

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1)


@functools.cache
def _checkpoint(root: str) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny random Phi-3, saved as transformers saves it (safetensors with fused qkv_proj and gate_up_proj)."""
    torch.manual_seed(0)
    return save_checkpoint(transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY)), root, "tiny-phi3")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    return _checkpoint(str(tmp_path_factory.mktemp("phi3")))


def test_checkpoint_is_fused_and_split_on_load(checkpoint) -> None:
    path, hf = checkpoint
    loaded = load_model(str(path))
    cfg = loaded.config
    assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == ("phi3", 4, 2, 16, 96)
    assert checkpoint_shapes(cfg)["model.layers.1.self_attn.qkv_proj.weight"] == (128, 64)  # (4 + 2·2) · 16 rows
    assert checkpoint_shapes(cfg)["model.layers.1.mlp.gate_up_proj.weight"] == (192, 64)
    assert not any("q_proj" in n or "gate_proj" in n for n in checkpoint_shapes(cfg))
    sd, hf_sd = loaded.state_dict, hf.state_dict()
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in sd)
    for i in range(2):
        qkv = hf_sd[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        gate_up = hf_sd[f"model.layers.{i}.mlp.gate_up_proj.weight"]
        p = f"model.layers.{i}."
        assert torch.equal(sd[p + "self_attn.q_proj.weight"], qkv[:64])
        assert torch.equal(sd[p + "self_attn.k_proj.weight"], qkv[64:96])
        assert torch.equal(sd[p + "self_attn.v_proj.weight"], qkv[96:])
        assert torch.equal(sd[p + "mlp.gate_proj.weight"], gate_up[:96])
        assert torch.equal(sd[p + "mlp.up_proj.weight"], gate_up[96:])
    assert torch.equal(sd["lm_head.weight"], hf_sd["lm_head.weight"])


@pytest.mark.parametrize("max_num_batched_tokens", [None, 7])
def test_greedy_equals_transformers_generate(checkpoint, max_num_batched_tokens: int | None) -> None:
    got, want = greedy_both_ways(*checkpoint, TINY["vocab_size"], max_num_batched_tokens)
    assert got == want


def test_a_wrong_split_order_breaks_exactness(checkpoint) -> None:
    """gate and up swapped (what reading gate_up_proj as [up; gate] would load): no longer transformers' tokens."""
    path, hf = checkpoint
    loaded = load_model(str(path))
    swapped = dict(loaded.state_dict)
    for i in range(loaded.config.num_layers):
        gate, up = f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"
        swapped[gate], swapped[up] = loaded.state_dict[up], loaded.state_dict[gate]
    prompts = random_prompts(TINY["vocab_size"])
    want = [hf_generate(hf, p) for p in prompts]
    wrong = LoadedModel(loaded.config, swapped, None, loaded.source_dir)
    got = engine_tokens(wrong, prompts)
    assert sum(g != w for g, w in zip(got, want)) >= 3


def test_config_mapping() -> None:
    base = {**TINY, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    cfg = config_from_hf(base, "m")
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rms_norm_eps, cfg.eos_token_ids) == (10000.0, None, 1e-5, (2,))
    assert not (cfg.attention_bias or cfg.qk_norm or cfg.tie_word_embeddings)
    defaults = config_from_hf({k: base[k] for k in ("architectures", "vocab_size", "hidden_size",
                                                    "intermediate_size", "num_hidden_layers",
                                                    "num_attention_heads")}, "m")
    assert (defaults.num_kv_heads, defaults.max_position_embeddings, defaults.eos_token_ids) == (4, 4096, (32000,))
    windowed = config_from_hf({**base, "max_position_embeddings": 4096, "sliding_window": 2047}, "m")
    assert (windowed.max_position_embeddings, windowed.sliding_window) == (4096, 2047)  # every layer windowed
    assert windowed.sliding_window_layers == tuple(range(TINY["num_hidden_layers"]))
    v5 = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                     "partial_rotary_factor": 1.0}}, "m")
    assert v5.rope_theta == 5e5


@pytest.mark.parametrize("rope", [{"type": "su", "short_factor": [1.0], "long_factor": [1.0]},
                                  {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
                                  {"type": "yarn", "factor": 4.0}])
def test_unsupported_rope_scaling_is_refused(rope: dict) -> None:
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ValueError, match=f"Phi-3: unsupported rope scaling type '{kind}'; supported: default"):
        config_from_hf({**TINY, "architectures": ["Phi3ForCausalLM"], "rope_scaling": rope}, "m")


def test_unsupported_fields_of_a_saved_config_are_refused(checkpoint) -> None:
    path, _ = checkpoint
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["Phi3ForCausalLM"]
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        config_from_hf({**saved, "rope_parameters": {**saved["rope_parameters"], "partial_rotary_factor": 0.5}}, "m")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        config_from_hf({**saved, "hidden_act": "gelu"}, "m")
