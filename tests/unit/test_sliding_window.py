"""Sliding-window attention in the Llama family, as transformers reads it from config.json: Mistral 7B v0.1's,
Phi-3's and Mixtral's `sliding_window` windows every layer, Qwen's use_sliding_window the layers from
max_window_layers on, `layer_types` where given. Greedy tokens equal transformers' on prompts longer than the window,
and the window is needed for that."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import transformers

from services.gpu_worker.attention.base import DEFAULT_ATTENTION
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.loader import LoadedModel, config_from_hf, load_model
from services.gpu_worker.model.llama_family import sliding_window_fields
from tests.unit.hf_checkpoints import engine_tokens, greedy_both_ways, hf_generate, random_prompts, save_checkpoint
from tests.unit.step_modes import step_mode  # noqa: F401 - step_mode: autouse, both modes

WINDOW = 5  # under random_prompts' 1-40 tokens, and not a multiple of the 4-token pages the engine tests use
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1, sliding_window=WINDOW)


@functools.cache
def _checkpoint(root: str) -> tuple[Path, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, attn_implementation="eager"))
    return save_checkpoint(model, root, "tiny-mistral-window")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    return _checkpoint(str(tmp_path_factory.mktemp("window")))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 7])
def test_mistral_window_greedy_equals_transformers(checkpoint, max_num_batched_tokens) -> None:
    got, want = greedy_both_ways(*checkpoint, TINY["vocab_size"], max_num_batched_tokens)
    assert got == want


def test_the_window_is_needed(checkpoint) -> None:
    path, hf = checkpoint
    loaded = load_model(str(path))
    assert loaded.config.sliding_window == WINDOW and loaded.config.sliding_window_layers == (0, 1)
    unwindowed = LoadedModel(dataclasses.replace(loaded.config, sliding_window=None, sliding_window_layers=()),
                             loaded.state_dict, loaded.tokenizer, loaded.source_dir)
    prompts = [p for p in random_prompts(TINY["vocab_size"]) if len(p) > WINDOW + 4]
    assert prompts
    want = [hf_generate(hf, p) for p in prompts]
    assert engine_tokens(loaded, prompts) == want
    assert engine_tokens(unwindowed, prompts) != want


def test_which_layers_are_windowed() -> None:
    base = {"num_hidden_layers": 4, "sliding_window": 8}
    assert sliding_window_fields(base) == {"sliding_window": 8, "sliding_window_layers": (0, 1, 2, 3)}
    assert sliding_window_fields({**base, "sliding_window": None}) == {}
    qwen = {**base, "use_sliding_window": True, "max_window_layers": 2}
    assert sliding_window_fields(qwen)["sliding_window_layers"] == (2, 3)
    assert sliding_window_fields({**qwen, "use_sliding_window": False}) == {}
    typed = {**base, "layer_types": ["full_attention", "sliding_attention"] * 2}
    assert sliding_window_fields(typed)["sliding_window_layers"] == (1, 3)
    cfg = config_from_hf({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 300,
                          "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "sliding_window": 4096}, "m")
    model = LlamaForCausalLM(cfg)
    assert all(layer.self_attn.spec.sliding_window == 4096 for layer in model.model.layers)
    assert cfg.max_position_embeddings == 131072  # the window no longer caps the context
    plain = config_from_hf({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 300,
                            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "sliding_window": None}, "m")
    assert all(layer.self_attn.spec == DEFAULT_ATTENTION for layer in LlamaForCausalLM(plain).model.layers)
