"""Gemma 3 (text) from a tiny transformers checkpoint: greedy tokens and their log-probabilities equal transformers'
fp32 generate(), and each of its own features (q/k norms, the local layers' RoPE base, the global layers' RoPE
scaling, the window) is needed for that; the config mapping, from transformers 5's rope_parameters and from the
released checkpoints' flat keys."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers

from services.gpu_worker.model.config import RopeScaling
from services.gpu_worker.model.gemma3 import Gemma3ForCausalLM
from services.gpu_worker.model.loader import LoadedModel, config_from_hf, load_model
from tests.unit.hf_checkpoints import greedy_both_ways, save_with_random_norms, worst_logprob_gap
from tests.unit.step_modes import step_mode  # noqa: F401 - step_mode: autouse, both modes

# local, global, local (pattern 2); a window of 8 (prompts reach 40 tokens); a local RoPE base of 100 against the
# global 1e6 scaled linearly by 4, so every feature shows in the outputs. No attention soft-cap (Gemma 3's default).
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=2, eos_token_id=1,
            pad_token_id=0, initializer_range=0.1, sliding_window=8, sliding_window_pattern=2,
            query_pre_attn_scalar=24, final_logit_softcapping=3.0, rope_theta=1e6, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0})


@functools.cache
def _checkpoint(root: str) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny random Gemma 3, its norm weights drawn too."""
    torch.manual_seed(0)
    return save_with_random_norms(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY)), root,
                                  "tiny-gemma3")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    return _checkpoint(str(tmp_path_factory.mktemp("gemma3")))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 7])
def test_greedy_equals_transformers_generate(checkpoint, max_num_batched_tokens: int | None) -> None:
    got, want = greedy_both_ways(*checkpoint, TINY["vocab_size"], max_num_batched_tokens)
    assert got == want


FEATURES_OFF = {
    "exact": {},
    "q/k norm": {"qk_norm": False},  # and the q_norm/k_norm weights dropped
    "local RoPE base": {"rope_local_theta": None},  # the local layers rotate as the global ones
    "global RoPE scaling": {"rope_scaling": None},
    "sliding window": {"sliding_window": None},
}


@pytest.mark.parametrize("off", list(FEATURES_OFF))
def test_logprobs_equal_transformers_only_with_every_feature(checkpoint, off: str) -> None:
    path, hf = checkpoint
    loaded = load_model(str(path))
    state_dict = loaded.state_dict
    if off == "q/k norm":
        state_dict = {n: t for n, t in state_dict.items() if not n.endswith(("q_norm.weight", "k_norm.weight"))}
    loaded = LoadedModel(loaded.config.with_(**FEATURES_OFF[off]), state_dict, None, loaded.source_dir)
    worst = worst_logprob_gap(loaded, hf, TINY["vocab_size"])
    assert worst < 1e-4 if off == "exact" else worst > 1e-2


def test_the_checkpoint_maps_to_local_and_global_layers(checkpoint) -> None:
    cfg = load_model(str(checkpoint[0])).config
    assert cfg.arch == "gemma3_text" and cfg.qk_norm and cfg.sliding_window_layers == (0, 2)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e6, RopeScaling("linear", 4.0), 100.0)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (None, 3.0, 24.0)


def test_config_mapping_defaults_and_flat_rope_keys() -> None:
    """The released checkpoints' config.json: rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern
    (transformers' own defaults for the keys left out)."""
    minimal = {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")}
    cfg = config_from_hf({**minimal, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 8}, "m")
    assert cfg.arch == "gemma3_text" and cfg.sliding_window_layers == (0, 1, 2, 3, 4, 6, 7)  # every 6th global
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local_theta) == (1e6, None, 1e4)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (None, None)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim, cfg.num_kv_heads) == (4096, 256.0, 256, 4)
    assert (cfg.qk_norm, cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (True, True, 2, (1,))
    flat = config_from_hf({**minimal, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4,
                           "sliding_window_pattern": 2, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
                           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "attn_logit_softcapping": 20.0,
                           "layer_types": None}, "m")
    assert flat.sliding_window_layers == (0, 2) and flat.attn_logit_softcapping == 20.0
    assert (flat.rope_theta, flat.rope_scaling, flat.rope_local_theta) == (5e5, RopeScaling("linear", 8.0), 2e4)
    with pytest.raises(ValueError, match="unsupported rope scaling 'linear' on the local layers"):
        config_from_hf({**minimal, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, "rope_parameters": {
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}, "m")
    with pytest.raises(ValueError, match="unsupported architecture 'Gemma3ForConditionalGeneration'"):
        config_from_hf({**minimal, "architectures": ["Gemma3ForConditionalGeneration"], "num_hidden_layers": 2}, "m")


def test_tensor_parallel_is_refused() -> None:
    class Group:
        size, rank = 2, 0

    cfg = config_from_hf({**TINY, "architectures": ["Gemma3ForCausalLM"], "rope_scaling": None}, "m")
    with pytest.raises(ValueError, match="Gemma 3 does not run tensor parallel yet"):
        Gemma3ForCausalLM(cfg, Group())


def test_the_cuda_path_keeps_the_torch_forward(checkpoint) -> None:
    """gemma2_fused.py has one RoPE table and no q/k norms: Gemma 3 stays on its torch blocks."""
    model = Gemma3ForCausalLM(load_model(str(checkpoint[0])).config)
    model.enable_fused_kernels()
    assert not model.is_fused
