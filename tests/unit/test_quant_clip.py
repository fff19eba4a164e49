"""The INT4 clip search (quant/clip.py): it never makes a row's calibration output error worse than plain RTN, it
clips the group of a large weight on a quiet input channel, it clips each end of a group's range on its own, and
the grid search (clip, then each group's scale and zero point refined) beats the clip alone in the AutoAWQ layout, and
`radixserve quantize`'s AWQ path quantizes on those grids and lowers the quantized model's error on its calibration
text."""
from __future__ import annotations

import torch

from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.awq import scale_activation_aware_
from services.gpu_worker.quant.clip import (CLIP_RATIOS, clip_delta, clipped, row_errors,
                                           search_clip, search_grid, shrunk_gram)
from services.gpu_worker.quant.int4 import dequantize_int4, from_awq, quantize_int4, quantize_int4_on, to_awq
from services.gpu_worker.quant.quality import sequence_logits
from tests.unit.test_quant_awq import _with_outliers
from tests.unit.test_quant_linear import _TOKENS


def _layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [256, 128] with channels of different loudness, w [48, 128]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 128, generator=gen) * torch.rand(128, generator=gen) * 4
    return x, torch.randn(48, 128, generator=gen)


def test_no_row_error_exceeds_plain_rtn_and_some_group_is_clipped() -> None:
    for seed in range(4):
        x, w = _layer(seed)
        gram = x.T @ x
        ratios = search_clip(w, gram, 32, max_rows=16)  # three row blocks
        assert ratios.shape == (48, 4, 2) and bool(torch.isin(ratios, torch.tensor(CLIP_RATIOS)).all())
        clipped_error = row_errors(clip_delta(w, ratios, 32), gram)  # [48]
        plain_error = row_errors(clip_delta(w, torch.ones_like(ratios), 32), gram)
        assert bool((clipped_error <= plain_error).all())
        assert (ratios < 1).any() and clipped_error.sum() < 0.95 * plain_error.sum(), seed


def test_a_large_weight_on_a_quiet_channel_is_clipped() -> None:
    x, w = _layer(0)
    x[:, 5] *= 1e-3  # channel 5 barely reaches the output
    w[0, 5] = 40.0  # ~13x the rest of its group: plain RTN's steps would be ~13x too coarse for them
    ratios = search_clip(w, x.T @ x, 32)
    assert ratios[0, 0, 1] == 0.5  # the smallest ratio there is: the clamp costs nothing through channel 5
    assert clipped(w, ratios, 32)[0, 5].item() == 20.0


def test_each_end_of_a_groups_range_is_clipped_on_its_own() -> None:
    x, w = _layer(0)
    x[:, 5] *= 1e-3  # channel 5 barely reaches the output: its large weight may be clamped
    x[:, 6] *= 10.0  # channel 6 is loud: its large negative weight must keep its value
    w[0, 5], w[0, 6] = 40.0, -40.0
    ratios = search_clip(w, x.T @ x, 32)
    assert ratios[0, 0, 1] <= 0.6 and ratios[0, 0, 0] >= 0.9, ratios[0, 0]  # high end clipped, low end (nearly) kept
    gram = x.T @ x
    symmetric = min(row_errors(clip_delta(w[:1], torch.full((1, 4, 2), r), 32), gram).item() for r in CLIP_RATIOS)
    assert row_errors(clip_delta(w[:1], ratios[:1], 32), gram).item() < 0.9 * symmetric


def test_the_grid_search_beats_the_clip_alone_and_keeps_the_awq_layout() -> None:
    for seed in range(4):
        x, w = _layer(seed)
        gram = shrunk_gram(x.T @ x)
        scales, zeros = search_grid(w, gram, 32, max_rows=16)
        assert torch.equal(scales, scales.half().float()) and bool((scales > 0).all())  # fp16 holds them exactly
        assert torch.equal(zeros, zeros.round()) and zeros.min() >= 0 and zeros.max() <= 15
        grid_error = row_errors(dequantize_int4(quantize_int4_on(w, scales, zeros, 32)).float() - w, gram)  # [48]
        clip_error = row_errors(clip_delta(w, search_clip(w, gram, 32), 32), gram)
        plain = quantize_int4(w, 32)  # RTN with its scales in fp16, as written
        plain_error = row_errors(dequantize_int4(quantize_int4_on(w, plain.scales.half().float(), plain.zeros, 32))
                                 .float() - w, gram)
        assert bool((grid_error <= plain_error).all())
        assert grid_error.sum() < 0.97 * clip_error.sum(), seed  # the refined grids beat the clipped ranges' RTN
        q = quantize_int4_on(w, scales, zeros, 32)  # written and read back as AutoAWQ GEMM: the same integers, grids
        back = from_awq(**to_awq(q), group_size=32)
        assert torch.equal(back.qweight, q.qweight) and torch.equal(back.zeros.float(), q.zeros)
        assert torch.equal(back.scales.float(), q.scales)


def test_the_shrunk_gram_keeps_its_diagonal_and_shrinks_the_rest() -> None:
    x, _ = _layer(0)
    gram = x.T @ x
    shrunk = shrunk_gram(gram, 0.3)
    assert torch.equal(shrunk.diagonal(), gram.diagonal())
    off = ~torch.eye(128, dtype=torch.bool)
    assert torch.allclose(shrunk[off], 0.7 * gram[off])


def test_the_writers_awq_path_quantizes_on_searched_grids_and_lowers_the_calibration_error() -> None:
    reference = sequence_logits(_with_outliers("tiny-llama"), _TOKENS)
    errors = {}
    for searched in (False, True):
        model = _with_outliers("tiny-llama")
        grids = {} if searched else None
        scale_activation_aware_(model, [_TOKENS], group_size=32, grids=grids)
        if searched:  # every grouped linear of every layer, on grids it would not get from RTN of its weight
            down = model.model.layers[0].mlp.down_proj
            assert len(grids) == 7 * len(model.model.layers) and down in grids
            assert not torch.equal(grids[down].scales, quantize_int4(down.weight.detach(), 32).scales)
        quantize_linears_(model, "awq", group_size=32, grids=grids)
        errors[searched] = ((sequence_logits(model, _TOKENS) - reference).norm() / reference.norm()).item()
    assert errors[True] < 0.9 * errors[False], errors
