"""bench/quant_quality.py's pieces on a tiny random model: the text, the AWQ-layout round trip of a quantized
model, the group sizes and the measures."""
from __future__ import annotations

import torch

from bench.quant_quality import (CALIBRATION_MODULES, MODULES, VARIANTS, build_model, fp8_weights_only_, group_sizes,
                                 measure, quantized, stdlib_text, through_awq_layout_)
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.fp8 import FP8_MAX
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.quant.quality import sequence_logits

_WINDOWS = [torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]


def test_the_text_is_deterministic_stdlib_prose() -> None:
    text = stdlib_text(5000)
    assert len(text) >= 5000 and text == stdlib_text(5000)
    assert text.startswith("JSON (JavaScript Object Notation)")
    assert not set(CALIBRATION_MODULES) & set(MODULES)
    calibration = stdlib_text(5000, CALIBRATION_MODULES)
    assert len(calibration) >= 5000 and not set(calibration.split("\n\n")) & set(text.split("\n\n"))


def test_the_awq_layout_round_trip_keeps_an_fp16_exact_model_and_the_measures_compare() -> None:
    loaded = load_model("random:tiny-llama", dtype=torch.float32)
    reference, ref_logits = measure(build_model(loaded), _WINDOWS, None)
    assert set(reference) == {"perplexity", "seconds"} and reference["perplexity"] > 1
    model = build_model(loaded)
    quantize_linears_(model, "awq", group_size=32)
    assert group_sizes(model) == {"64": 32, "128": 32}
    before = sequence_logits(model, _WINDOWS[0])
    through_awq_layout_(model)
    assert model.model.layers[0].mlp.up_proj.scales.dtype == torch.float32
    assert torch.allclose(sequence_logits(model, _WINDOWS[0]), before, atol=1e-3)  # only the scales' fp16 rounding
    result, logits = measure(model, _WINDOWS, ref_logits)
    assert len(logits) == 2 and logits[0].shape == (24, 512)
    assert 0.5 <= result["top1_agreement"] <= 1 and 0 <= result["mean_kl_nats"] < 0.1
    same, _ = measure(build_model(loaded), _WINDOWS, ref_logits)
    assert same["top1_agreement"] == 1.0 and abs(same["mean_kl_nats"]) < 1e-6


def test_every_variant_builds_and_fp8_weights_only_rounds_the_weights_in_place() -> None:
    loaded = load_model("random:tiny-llama", dtype=torch.float32)
    for variant in (v for v in VARIANTS if v != "int4_gguf"):  # the GGUF's blocks fit the bundled model only
        model, changed = quantized(loaded, variant, 128, calibration=_WINDOWS)
        assert changed == 14, variant
        layer = model.model.layers[1].mlp.down_proj
        assert isinstance(layer, torch.nn.Linear) == (variant == "fp8_weights_only")
    assert group_sizes(quantized(loaded, "int4_rtn_g32", 128)[0]) == {"64": 32, "128": 32}
    assert group_sizes(quantized(loaded, "int4_rtn", 128)[0]) == {"64": 64, "128": 128}
    assert group_sizes(quantized(loaded, "int4_gptq", 128, calibration=_WINDOWS)[0]) == {"64": 64, "128": 128}
    model = build_model(loaded)
    dense = model.model.layers[0].self_attn.q_proj.weight.clone()
    assert fp8_weights_only_(model) == 14
    rounded = model.model.layers[0].self_attn.q_proj.weight
    scale = dense.abs().amax(dim=1, keepdim=True) / FP8_MAX
    assert not torch.equal(rounded, dense) and ((rounded - dense).abs() <= dense.abs() / 16 + scale / 1024).all()
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_the_gguf_variant_installs_the_bundled_files_own_blocks() -> None:
    from services.gpu_worker.model.loader import load_bundled

    model, changed = quantized(load_bundled(dtype=torch.float32), "int4_gguf", 128)
    assert changed == 210 and group_sizes(model) == {"576": 32, "1536": 32}
    assert isinstance(model.model.layers[29].mlp.down_proj, QuantizedLinear)
