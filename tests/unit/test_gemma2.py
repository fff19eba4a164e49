"""Gemma 2 from a tiny transformers checkpoint: greedy tokens and their log-probabilities equal transformers' fp32
generate(), and each of its features (attention and final soft-capping, sliding window, query_pre_attn_scalar) is
needed for that; the config mapping; the CUDA path keeps the torch forward (attention on the Triton backend)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers

from services.gpu_worker.model.gemma2 import Gemma2ForCausalLM
from services.gpu_worker.model.loader import LoadedModel, config_from_hf, load_model
from tests.unit.hf_checkpoints import greedy_both_ways, save_with_random_norms, worst_logprob_gap
from tests.unit.step_modes import step_mode  # noqa: F401 - step_mode: autouse, both modes

# strong caps and a window of 8 (prompts reach 40 tokens), so every feature shows in the outputs
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=2, eos_token_id=1,
            pad_token_id=0, initializer_range=0.1, sliding_window=8, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


@functools.cache
def _checkpoint(root: str) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny random Gemma 2, its norm weights drawn too."""
    torch.manual_seed(0)
    return save_with_random_norms(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**TINY)), root,
                                  "tiny-gemma2")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    return _checkpoint(str(tmp_path_factory.mktemp("gemma2")))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 7])
def test_greedy_equals_transformers_generate(checkpoint, max_num_batched_tokens: int | None) -> None:
    got, want = greedy_both_ways(*checkpoint, TINY["vocab_size"], max_num_batched_tokens)
    assert got == want


FEATURES_OFF = {
    "exact": {},
    "attention soft-cap": {"attn_logit_softcapping": None},
    "final soft-cap": {"final_logit_softcapping": None},
    "sliding window": {"sliding_window_layers": ()},
    "query_pre_attn_scalar": {"query_pre_attn_scalar": 16.0},  # head_dim: the default scale
}


@pytest.mark.parametrize("off", list(FEATURES_OFF))
def test_logprobs_equal_transformers_only_with_every_feature(checkpoint, off: str) -> None:
    """The chosen tokens' log-probabilities match transformers' to 1e-4; without any one feature they do not
    (final soft-capping never changes the greedy token, only the probabilities)."""
    path, hf = checkpoint
    loaded = load_model(str(path))
    loaded = LoadedModel(loaded.config.with_(**FEATURES_OFF[off]), loaded.state_dict, None, loaded.source_dir)
    worst = worst_logprob_gap(loaded, hf, TINY["vocab_size"])
    assert worst < 1e-4 if off == "exact" else worst > 1e-2


def test_config_mapping() -> None:
    minimal = {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")}
    cfg = config_from_hf({**minimal, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 5}, "m")
    assert cfg.arch == "gemma2" and cfg.sliding_window_layers == (0, 2, 4)  # transformers' default layer_types
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim, cfg.num_kv_heads) == (4096, 256.0, 256, 4)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.tie_word_embeddings) == (50.0, 30.0, True)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.rms_norm_eps) == (2, (1,), 1e-6)
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    custom = config_from_hf({**TINY, "architectures": ["Gemma2ForCausalLM"], "layer_types": types,
                             "final_logit_softcapping": None}, "m")
    assert custom.sliding_window_layers == (1, 2) and custom.final_logit_softcapping is None
    with pytest.raises(ValueError, match="Gemma 2: unsupported hidden_activation 'gelu'"):
        config_from_hf({**TINY, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"}, "m")


def test_the_cuda_path_fuses_gemma2_and_tensor_parallel_is_refused() -> None:
    """Gemma 2 takes its own fused forward (model/gemma2_fused.py; equal to the torch one on the interpreter:
    tests/kernels/test_triton_engine.py); Gemma 3 keeps the torch forward."""
    cfg = config_from_hf({**TINY, "architectures": ["Gemma2ForCausalLM"]}, "m")
    model = Gemma2ForCausalLM(cfg)
    model.enable_fused_kernels()
    assert model.is_fused and model.model.layers[0].mlp.gate_up_weight.shape == (2 * cfg.intermediate_size,
                                                                                cfg.hidden_size)

    class Group:
        size, rank = 2, 0

    with pytest.raises(ValueError, match="Gemma 2 does not run tensor parallel yet"):
        Gemma2ForCausalLM(cfg, Group())
