"""Tests of config conversion, random presets and HF-directory loading against transformers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from services.gpu_worker.model.config import ModelConfig, RopeScaling
from services.gpu_worker.model.loader import (
    config_from_hf,
    hf_config_dict,
    load_model,
    param_shapes,
    random_state_dict,
    unpermute_qk,
)
from services.gpu_worker.model.presets import PRESETS
from tests.unit.test_model_registry import WRITABLE  # presets whose family writes config.json (test_presets.py: others)

TINY = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-smollm2"]


def write_hf_dir(path: Path, cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    save_file(state_dict, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("name", TINY)
def test_random_is_deterministic_per_seed(name: str) -> None:
    a = load_model(f"random:{name}", seed=7)
    b = load_model(f"random:{name}", seed=7)
    c = load_model(f"random:{name}", seed=8)
    assert a.config == PRESETS[name] and a.config.model_id == f"random:{name}"
    assert a.tokenizer is None and a.source_dir is None
    assert list(a.state_dict) == list(param_shapes(a.config))
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert not any(torch.equal(a.state_dict[k], c.state_dict[k]) for k in a.state_dict)


def test_random_values_and_dtype() -> None:
    sd = random_state_dict(PRESETS["tiny-qwen2"], dtype=torch.bfloat16, seed=0)
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in sd.values())
    fp32 = random_state_dict(PRESETS["tiny-qwen2"], seed=0)
    assert torch.equal(sd["model.embed_tokens.weight"], fp32["model.embed_tokens.weight"].bfloat16())
    norm = fp32["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean().item() < 1.1 and 0.05 < norm.std().item() < 0.15
    emb = fp32["model.embed_tokens.weight"]
    assert abs(emb.mean().item()) < 1e-3 and 0.019 < emb.std().item() < 0.021
    assert fp32["model.layers.1.self_attn.k_proj.bias"].shape == (32,)


def test_param_names() -> None:
    qwen3 = param_shapes(PRESETS["tiny-qwen3"])
    assert qwen3["model.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert qwen3["model.layers.0.self_attn.o_proj.weight"] == (64, 128)
    assert qwen3["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert "lm_head.weight" in qwen3 and "model.layers.0.self_attn.q_proj.bias" not in qwen3
    smol = param_shapes(PRESETS["tiny-smollm2"])
    assert "lm_head.weight" not in smol and len(smol) == 1 + 2 * 9 + 1
    assert len(param_shapes(PRESETS["tiny-qwen2"])) == 1 + 2 * 12 + 2


@pytest.mark.parametrize("name", WRITABLE)
def test_hf_config_round_trip(name: str) -> None:
    cfg = PRESETS[name]
    assert config_from_hf(hf_config_dict(cfg), cfg.model_id) == cfg


def test_real_preset_shapes() -> None:
    llama = PRESETS["llama3-8b"]
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (llama.hidden_size, llama.num_layers, llama.num_kv_heads, llama.vocab_size) == (4096, 32, 8, 128256)
    total = sum(torch.Size(s).numel() for s in param_shapes(llama).values())
    assert total == 8_030_261_248
    qwen = PRESETS["qwen3-0.6b"]
    assert sum(torch.Size(s).numel() for s in param_shapes(qwen).values()) == 596_049_920
    smol = PRESETS["smollm2-135m"]
    assert sum(torch.Size(s).numel() for s in param_shapes(smol).values()) == 134_515_008


def test_config_from_hf_defaults_and_variants() -> None:
    base = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    llama = config_from_hf({**base, "model_type": "llama", "head_dim": None}, "m")
    assert (llama.head_dim, llama.num_kv_heads, llama.rms_norm_eps) == (16, 4, 1e-6)
    assert (llama.tie_word_embeddings, llama.bos_token_id, llama.eos_token_ids) == (False, 1, (2,))
    assert (llama.rope_theta, llama.rope_scaling, llama.max_position_embeddings) == (10000.0, None, 2048)
    qwen3 = config_from_hf({**base, "model_type": "qwen3", "eos_token_id": [5, 6]}, "m")
    assert (qwen3.head_dim, qwen3.num_kv_heads, qwen3.qk_norm, qwen3.eos_token_ids) == (128, 32, True, (5, 6))
    qwen2 = config_from_hf({**base, "model_type": "qwen2", "tie_word_embeddings": True}, "m")
    assert qwen2.attention_bias and qwen2.tie_word_embeddings and qwen2.eos_token_ids == ()
    linear = config_from_hf({**base, "model_type": "mistral", "rope_scaling": {"type": "linear", "factor": 2}}, "m")
    assert linear.rope_scaling == RopeScaling("linear", 2.0) and linear.num_kv_heads == 8
    v5 = config_from_hf(
        {**base, "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "m"
    )
    assert v5.rope_theta == 5e5 and v5.rope_scaling is None


def test_config_from_hf_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        config_from_hf({"model_type": "gpt2"}, "m")
    with pytest.raises(ValueError, match="lacks required keys: intermediate_size, num_attention_heads"):
        config_from_hf({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1}, "m")
    llama = hf_config_dict(PRESETS["tiny-llama"])
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "m")
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({"model_type": "llama", "hidden_act": "gelu"}, "m")
    with pytest.raises(ValueError, match="attention_bias"):
        hf_config_dict(PRESETS["tiny-qwen2"].with_(attention_bias=False))


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*tiny-llama"):
        load_model("random:nope")
    with pytest.raises(FileNotFoundError, match="neither 'bundled'"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(PRESETS["tiny-llama"])))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_our_weights_identically(name: str, tmp_path: Path) -> None:
    ours = load_model(f"random:{name}", seed=3)
    path = write_hf_dir(tmp_path / name, ours.config, ours.state_dict)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(hf).__name__ == hf_config_dict(ours.config)["architectures"][0]
    hf_sd = hf.state_dict()
    if ours.config.tie_word_embeddings:
        assert torch.equal(hf_sd.pop("lm_head.weight"), ours.state_dict["model.embed_tokens.weight"])
    assert sorted(hf_sd) == sorted(ours.state_dict)
    assert all(torch.equal(hf_sd[k], ours.state_dict[k]) for k in hf_sd)
    reloaded = load_model(str(path))
    assert reloaded.config == ours.config.with_(model_id=name)
    assert reloaded.source_dir == str(path.resolve()) and reloaded.tokenizer is None
    assert list(reloaded.state_dict) == list(ours.state_dict)
    assert all(torch.equal(reloaded.state_dict[k], ours.state_dict[k]) for k in ours.state_dict)


def test_transformers_config_matches(tmp_path: Path) -> None:
    cfg = PRESETS["tiny-llama"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    rope = hf.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("llama3", 8.0, 500000.0)
    assert (hf.head_dim, hf.num_key_value_heads, hf.eos_token_id) == (16, 2, [2, 3])
    assert config_from_hf(hf.to_dict(), cfg.model_id) == cfg


def test_sharded_bf16_dir_with_extras(tmp_path: Path) -> None:
    cfg = PRESETS["tiny-smollm2"]
    sd = random_state_dict(cfg, dtype=torch.bfloat16, seed=1)
    names = list(sd)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    save_file({n: sd[n] for n in names[:5]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    extras = {"lm_head.weight": sd["model.embed_tokens.weight"], "rotary.inv_freq": torch.ones(8)}
    save_file({**{n: sd[n] for n in names[5:]}, **extras}, str(tmp_path / "model-00002-of-00002.safetensors"))
    loaded = load_model(str(tmp_path), dtype=torch.float16)
    assert loaded.config.eos_token_ids == (2, 9)
    assert list(loaded.state_dict) == names
    assert all(loaded.state_dict[n].dtype == torch.float16 for n in names)
    assert all(torch.equal(loaded.state_dict[n], sd[n].half()) for n in names)


def test_missing_weight_is_reported(tmp_path: Path) -> None:
    cfg = PRESETS["tiny-llama"]
    sd = random_state_dict(cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    write_hf_dir(tmp_path, cfg, sd)
    with pytest.raises(ValueError, match="1 weights missing.*layers.1.mlp.up_proj"):
        load_model(str(tmp_path))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp applies it to q and k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_qk_inverts_llama_cpp_permute(n_head: int) -> None:
    w = torch.randn(n_head * 64, 24)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, n_head), w)
    assert torch.equal(permuted[1], w[32]) and torch.equal(permuted[2], w[1])


def _salt_specs(tmp_path: Path) -> list[str]:
    cfg = PRESETS["tiny-llama"]
    sd = random_state_dict(cfg, seed=0)
    hub = write_hf_dir(tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "abc123", cfg, sd)
    plain = write_hf_dir(tmp_path / "plain-tiny", cfg, sd)
    return ["random:tiny-llama", str(hub), str(plain)]


def test_tokenizer_and_loader_derive_the_same_salt(tmp_path: Path) -> None:
    from services.tokenizer import model_files

    ids = {spec: (model_files.model_id_for(spec), load_model(spec).config.model_id) for spec in _salt_specs(tmp_path)}

    assert list(ids.values()) == [("random:tiny-llama",) * 2, ("Org/Tiny",) * 2, ("plain-tiny",) * 2]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["bundled", "smollm2-135m-instruct"])
def test_tokenizer_and_loader_derive_the_same_salt_for_the_bundled_model(spec: str) -> None:
    from services.tokenizer import model_files

    assert model_files.model_id_for(spec) == load_model(spec).config.model_id == "smollm2-135m-instruct"
