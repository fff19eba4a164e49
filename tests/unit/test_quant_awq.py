"""Activation-aware INT4 scaling (quant/awq.py): folding the scales leaves the float model's output unchanged (GQA,
v_proj bias and MoE layers included), the search beats plain round-to-nearest on inputs with outlier channels, and
quantize_linears_ with calibration windows runs it before rounding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.awq import int4_rtn, scale_activation_aware_, scale_groups, search_scale
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.quant.quality import sequence_logits
from tests.unit.test_quant_linear import _TOKENS, _tiny_model


def _with_outliers(preset_name: str) -> nn.Module:
    """A tiny model whose layer inputs have a few large channels, as trained models' do: some norm weights and
    up_proj rows scaled up."""
    model = _tiny_model(preset_name)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.mul_(1 + 19 * (torch.rand(norm.weight.shape, generator=gen) < 0.1))
            up = getattr(layer.mlp, "up_proj", None)
            if up is not None:
                up.weight.mul_(1 + 9 * (torch.rand(up.weight.shape[0], 1, generator=gen) < 0.1))
            layer.self_attn.v_proj.weight.mul_(1 + 9 * (torch.rand(layer.self_attn.v_proj.weight.shape[0], 1,
                                                                   generator=gen) < 0.2))
    return model


@pytest.mark.parametrize("preset_name, num_groups", [("tiny-llama", 8), ("tiny-qwen2", 8), ("tiny-qwen3-moe", 6)])
def test_folding_the_scales_leaves_the_float_model_unchanged(preset_name: str, num_groups: int) -> None:
    model = _with_outliers(preset_name)
    reference = sequence_logits(model, _TOKENS)
    alphas = scale_activation_aware_(model, [_TOKENS[:40], _TOKENS[20:]], group_size=32)
    assert len(alphas) == num_groups  # qkv, o, gate/up, down a dense layer; an MoE layer: qkv, o
    assert max(alphas) > 0  # some scale is not 1: the check below is not vacuous
    assert torch.allclose(sequence_logits(model, _TOKENS), reference, rtol=1e-4, atol=1e-4)


def test_gqa_query_heads_of_one_kv_head_share_their_scales() -> None:
    layer = _tiny_model("tiny-llama").model.layers[0]  # 4 query heads, 2 kv heads, head_dim 16
    o_group = scale_groups(layer)[1]
    assert o_group.linears == [layer.self_attn.o_proj] and o_group.prev is layer.self_attn.v_proj
    assert o_group.tie.tolist() == [*range(16), *range(16), *range(16, 32), *range(16, 32)]


def test_the_search_beats_round_to_nearest_on_outlier_channels() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=gen) * (1 + 29 * (torch.arange(256) % 32 == 0))  # 8 channels ×30
    w = torch.randn(64, 256, generator=gen)
    quantize = int4_rtn(64)
    s, alpha = search_scale(x, [w], quantize)
    rtn = (x @ (quantize(w) - w).T).norm()
    scaled = ((x / s) @ quantize(w * s).T - x @ w.T).norm()
    assert alpha > 0 and scaled < 0.8 * rtn, (alpha, scaled, rtn)


def test_calibrated_int4_on_load_scales_then_rounds_and_beats_plain_rtn() -> None:
    reference = sequence_logits(_with_outliers("tiny-llama"), _TOKENS)
    errors = {}
    for calibration in (None, [_TOKENS]):
        model = _with_outliers("tiny-llama")
        assert quantize_linears_(model, "awq", group_size=32, calibration=calibration) == 14
        assert isinstance(model.model.layers[1].mlp.down_proj, QuantizedLinear)
        errors[calibration is None] = ((sequence_logits(model, _TOKENS) - reference).norm() / reference.norm()).item()
    assert errors[False] < 0.8 * errors[True], errors


def test_the_scale_search_runs_on_one_cpu_thread_and_restores_the_count(monkeypatch) -> None:
    """Each group's α search (many small ops) runs on one intra-op thread: beside another busy job on 2 cores, two
    threads made the bundled model's on-load search ~5x slower (quant/awq.py's NOTE). The count comes back after."""
    from services.gpu_worker.quant import awq

    seen: list[int] = []
    real = awq.search_scale
    monkeypatch.setattr(awq, "search_scale", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alphas = scale_activation_aware_(_with_outliers("tiny-llama"), [_TOKENS[:40]], group_size=32)
        assert seen == [1] * len(alphas) and len(alphas) == 8 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
