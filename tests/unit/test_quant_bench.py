"""bench/quant_quality.py's pieces on a tiny random model: the text, the AWQ-layout round trip of a quantized
model, the group sizes and the measures."""
from __future__ import annotations

import torch

from bench.quant_quality import build_model, group_sizes, measure, stdlib_text, through_awq_layout_
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.quality import sequence_logits

_WINDOWS = [torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]


def test_the_text_is_deterministic_stdlib_prose() -> None:
    text = stdlib_text(5000)
    assert len(text) >= 5000 and text == stdlib_text(5000)
    assert text.startswith("JSON (JavaScript Object Notation)")


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
