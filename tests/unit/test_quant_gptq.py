"""GPTQ (quant/gptq.py): on correlated inputs its output error beats round-to-nearest's at the same group size (INT4)
or in the same e4m3 per-channel format (FP8) or on the same fixed INT4 grids, an act-order result dequantizes and
round-trips the GPTQ v1 layout exactly, and calibrate_gptq_ replaces a tiny model's decoder linears layer by layer."""
from __future__ import annotations

import torch
from torch import nn

from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.fp8 import dequantize_fp8, quantize_weight_fp8
from services.gpu_worker.quant.gptq import (_sharing_inputs, calibrate_gptq_, gptq_quantize, gptq_quantize_fp8,
                                             gptq_quantize_on_grid, layer_groups)
from services.gpu_worker.quant.int4 import (dequantize_int4, from_gptq, int4_linear, quantize_int4, quantize_int4_on,
                                            to_gptq)
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.quant.quality import sequence_logits
from services.gpu_worker.quant.targets import linear_targets
from tests.unit.test_quant_linear import _TOKENS, _tiny_model


def _problem(k: int = 256, n: int = 64, t: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Correlated inputs X [T, K] of uneven scales, weights W [N, K] and H = 2 XᵀX / T."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    x = torch.randn(t, k, generator=gen) @ mix * torch.linspace(0.2, 3, k)
    return x, torch.randn(n, k, generator=gen), 2 * x.T @ x / t


def _output_error(x: torch.Tensor, w: torch.Tensor, approx: torch.Tensor) -> float:
    return ((x @ w.T - x @ approx.T).norm() / (x @ w.T).norm()).item()


def test_gptq_beats_round_to_nearest_on_the_layer_output() -> None:
    x, w, h = _problem()
    for group_size in (32, 64, 128):
        rtn = _output_error(x, w, dequantize_int4(quantize_int4(w, group_size)))
        for act_order in (False, True):
            gptq = _output_error(x, w, dequantize_int4(gptq_quantize(w, h, group_size, act_order)))
            assert gptq < 0.93 * rtn, (group_size, act_order, gptq, rtn)


def test_the_grid_is_quantize_int4s_and_no_input_means_rtn() -> None:
    _, w, _ = _problem()
    plain = gptq_quantize(w, torch.eye(256), 64, block=64)  # H = I: no correlation, nothing to spread
    rtn = quantize_int4(w, 64)
    assert torch.equal(plain.qweight, rtn.qweight) and torch.equal(plain.scales, rtn.scales)
    assert torch.equal(plain.zeros, rtn.zeros) and plain.perm is None


def test_gptq_on_fixed_grids_keeps_them_and_beats_rounding_to_nearest_on_them() -> None:
    x, w, h = _problem()
    grid = quantize_int4(w, 64)  # any fixed grids: RTN's, scales as fp16 holds them
    scales = grid.scales.half().float()
    q = gptq_quantize_on_grid(w, h, scales, grid.zeros, 64)
    assert q.perm is None and torch.equal(q.scales, scales) and torch.equal(q.zeros, grid.zeros)
    rtn = dequantize_int4(quantize_int4_on(w, scales, grid.zeros, 64))
    assert _output_error(x, w, dequantize_int4(q)) < 0.93 * _output_error(x, w, rtn)  # 0.079 against 0.090


def test_act_order_dequantizes_consistently_and_round_trips_gptq_v1_exactly() -> None:
    x, w, h = _problem()
    q = gptq_quantize(w.half(), h, 64, act_order=True)
    assert q.perm is not None and not torch.equal(q.perm, torch.arange(256))
    assert torch.equal(torch.sort(q.perm).values, torch.arange(256))
    assert q.scales.dtype == torch.float16
    dense = dequantize_int4(q)  # [N, K] input-feature order
    xs = x[:16]
    expected = xs @ dequantize_int4(_float(q)).T  # [16, N]
    assert torch.allclose(int4_linear(xs, _float(q)), expected, rtol=1e-4, atol=1e-3)
    back = from_gptq(**to_gptq(q), group_size=64)
    for name in ("qweight", "scales", "zeros", "perm"):
        assert torch.equal(getattr(back, name), getattr(q, name)), name
    assert torch.equal(dequantize_int4(back), dense)


def _float(q):
    return type(q)(q.qweight, q.scales.float(), q.zeros.float(), q.group_size, q.perm)


def test_calibrate_gptq_replaces_every_decoder_linear_layer_by_layer() -> None:
    model = _tiny_model("tiny-llama")
    reference = sequence_logits(model, _TOKENS)
    groups = layer_groups(linear_targets(model))
    assert [len(g) for g in groups] == [7, 7] and groups[1][0][0].startswith("model.layers.1.")
    assert calibrate_gptq_(model, [_TOKENS[:40], _TOKENS[20:]], group_size=32, act_order=True) == 14
    assert not any(isinstance(m, nn.Linear) for name, m in model.named_modules() if name != "lm_head")
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.group_size == 32 and layer.perm is not None
    logits = sequence_logits(model, _TOKENS)
    assert (logits - reference).norm() / reference.norm() < 0.2


def test_calibrate_gptq_keeps_the_moe_router_dense() -> None:
    model = _tiny_model("tiny-qwen3-moe")
    assert calibrate_gptq_(model, [_TOKENS]) == 11
    assert all(isinstance(m, nn.Linear) for name, m in model.named_modules() if name.endswith("mlp.gate"))


def test_gptq_fp8_beats_round_to_nearest_in_the_same_format() -> None:
    x, w, h = _problem()
    rtn_q, rtn_scale = quantize_weight_fp8(w)
    rtn = _output_error(x, w, dequantize_fp8(rtn_q, rtn_scale))
    for act_order in (False, True):
        q, scale = gptq_quantize_fp8(w, h, act_order)
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and torch.equal(scale, rtn_scale)
        gptq = _output_error(x, w, dequantize_fp8(q, scale))
        assert gptq < 0.93 * rtn, (act_order, gptq, rtn)


def test_gptq_fp8_without_correlation_is_round_to_nearest() -> None:
    _, w, _ = _problem()
    q, scale = gptq_quantize_fp8(w, torch.eye(256), act_order=False)
    rtn_q, rtn_scale = quantize_weight_fp8(w)
    assert torch.equal(q.view(torch.uint8), rtn_q.view(torch.uint8)) and torch.equal(scale, rtn_scale)


def test_calibrate_gptq_fp8_gives_fp8_layers_closer_than_rtn() -> None:
    reference = sequence_logits(_tiny_model("tiny-llama"), _TOKENS)
    errors = {}
    for calibrated in (False, True):
        model = _tiny_model("tiny-llama")
        if calibrated:
            assert calibrate_gptq_(model, [_TOKENS], act_order=True, method="fp8") == 14
        else:
            quantize_linears_(model, "fp8")
        layer = model.model.layers[1].mlp.down_proj
        assert isinstance(layer, QuantizedLinear) and layer.method == "fp8"
        errors[calibrated] = ((sequence_logits(model, _TOKENS) - reference).norm() / reference.norm()).item()
    assert errors[True] < errors[False], errors


def test_linears_that_share_their_inputs_are_quantized_as_one_stack() -> None:
    targets = layer_groups(linear_targets(_tiny_model("tiny-llama")))[0]  # q k v o gate up down
    h, other = torch.eye(64), 2 * torch.eye(64)
    hessians = {targets[0][0]: h, targets[1][0]: h.clone(), targets[2][0]: h.clone(), targets[3][0]: other,
                targets[4][0]: h.clone(), targets[5][0]: h.clone()}  # down_proj never ran
    runs = _sharing_inputs(targets, hessians)
    assert [[t[0].rsplit(".", 1)[1] for t in run] for run in runs] == [
        ["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
