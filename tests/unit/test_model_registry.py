"""Tests of the model registry: config.json's architectures[0] picks the entry; unknown ones are refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.loader import config_from_hf, hf_config_dict, load_model
from services.gpu_worker.model.presets import PRESETS
from services.gpu_worker.model.registry import ARCHITECTURES, architecture_for_hf, architecture_for_type

SUPPORTED = ("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
             "MixtralForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM")
BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4}


def test_registered_names_are_transformers_causal_lm_classes() -> None:
    assert ", ".join(ARCHITECTURES) == SUPPORTED
    for name, arch in ARCHITECTURES.items():
        assert transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch.model_type] == name
        assert issubclass(arch.model_class, LlamaForCausalLM)


def test_unknown_architecture_is_refused_at_load(tmp_path: Path) -> None:
    cfg = {**BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; supported: {SUPPORTED}$"):
        load_model(str(tmp_path))


def test_a_known_model_type_with_another_head_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForSequenceClassification'"):
        config_from_hf({**BASE, "architectures": ["LlamaForSequenceClassification"], "model_type": "llama"}, "m")


def test_architectures_picks_the_entry_and_model_type_is_the_fallback() -> None:
    assert architecture_for_hf({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}).model_type == "qwen3"
    assert architecture_for_hf({"model_type": "mistral"}).hf_name == "MistralForCausalLM"
    supported_types = "llama, mistral, qwen2, qwen3, phi3, mixtral, qwen3_moe, gemma2, gemma3_text"
    with pytest.raises(ValueError, match=f"unsupported model_type 'gpt2'; supported: {supported_types}"):
        architecture_for_hf({"model_type": "gpt2"})


# the presets whose family has a config.json writer (not yet Qwen3-MoE's nor Gemma's: random:qwen3-30b-a3b and
# random:gemma2-9b are tested in test_presets.py)
WRITABLE = [name for name, cfg in PRESETS.items() if architecture_for_type(cfg.arch).config_to_hf is not None]


@pytest.mark.parametrize("name", WRITABLE)
def test_random_presets_map_onto_registered_architectures(name: str) -> None:
    cfg = PRESETS[name]
    arch = architecture_for_type(cfg.arch)
    assert hf_config_dict(cfg)["architectures"] == [arch.hf_name]
    assert architecture_for_hf(hf_config_dict(cfg)) is arch


def test_phi3_has_no_config_writer() -> None:
    phi3 = config_from_hf({**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}, "m")
    with pytest.raises(ValueError, match="Phi3ForCausalLM has no config.json writer"):
        hf_config_dict(phi3)
