"""Weight clipping for INT4 round-to-nearest (the clip search of AWQ: Lin et al. 2023), written from the method: each
group of G input columns of each output row gets two ratios (r_low, r_high) that shrink the two ends of its range
[min(w, 0), max(w, 0)] to [r_low · min, r_high · max] before RTN computes the group's scale and zero point. A smaller
range gives finer steps to the group's bulk at the price of clamping its extremes; the ratios are chosen on
calibration inputs x [T, K] by the error of the layer's output. The search is by coordinates over CLIP_RATIOS: one
ratio for both ends first (AWQ's own search), then the low end alone with the high end at its best so far, then the
high end alone (33 candidates). Shrinking each end on its own lets a group clamp an outlier on one side without
coarsening the other side's steps: on the bundled SmolLM2-135M (groups of 64, 1,024 calibration tokens) the
written AWQ model's perplexity went from +13.7 % to +12.7 % over float32 (bench/quant_quality.py).

The error of a row n, ‖x (Q(w_n) − w_n)‖², is δ_n (xᵀx) δ_nᵀ with δ_n = Q(w_n) − w_n: through the Gram matrix
xᵀx [K, K] it costs nothing per token. Each group's ratios are chosen by its own block of the Gram matrix (the cross
terms between groups left out, so the groups of a row are chosen independently, all at once); a row whose whole-row
error the choice made worse than no clipping keeps ratios 1 everywhere, so on the calibration rows no layer's output
error exceeds plain RTN's. Rows are searched in blocks of `max_rows` to bound the memory of the candidates.

search_grid (what `radixserve quantize --method awq` uses) then refines each group's grid itself: RTN of the clipped
range gives a scale s and an integer zero point z, i.e. the grid s · {−z, …, 15 − z}; the candidates s · f (f in
GRID_FACTORS, 0.86 … 1.14) with z − 1, z or z + 1 (45, each scale as fp16 holds it) are scored by the same
per-group error, and each group keeps its best. The grid stays the AutoAWQ one (fp16 scale, integer zero point),
only chosen by the output error instead of by the range's ends.

The Gram matrix a search scores with is shrunk (shrunk_gram): its off-diagonal entries times 1 − GRAM_SHRINK. From a
thousand calibration tokens, xᵀx of a K = 1536 input has rank ≤ 1,000 and its cross terms fit the calibration text:
the shrunk one (a covariance estimate pulled towards its diagonal) chose weights that did better on other text.
"""
from __future__ import annotations

import torch

from services.gpu_worker.quant.int4 import dequantize_int4, quantize_int4, quantize_int4_on, round_on_grid

CLIP_RATIOS = tuple(1 - i / 20 for i in range(11))  # 1.0, 0.95, …, 0.5
GRID_FACTORS = tuple(1 + i / 50 for i in range(-7, 8))  # 0.86, 0.88, …, 1.14: a group's scale times each
ZERO_STEPS = (-1, 0, 1)  # a group's zero point plus each
GRAM_SHRINK = 0.5


def shrunk_gram(gram: torch.Tensor, shrink: float = GRAM_SHRINK) -> torch.Tensor:
    """xᵀx [K, K] with its off-diagonal entries times 1 − shrink, its diagonal kept (module docstring)."""
    out = gram * (1 - shrink)
    out.diagonal().copy_(gram.diagonal())
    return out


def group_ranges(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (low, high) [N, K // G, 1] each: the range RTN quantizes a group over (quant/int4.py)."""
    groups = w.reshape(w.shape[0], -1, group_size)  # [N, K // G, G]
    return groups.amin(dim=-1, keepdim=True).clamp(max=0), groups.amax(dim=-1, keepdim=True).clamp(min=0)


def clipped(w: torch.Tensor, ratios: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] with each group's range clamped by `ratios` [N, K // G, 2] → [N, K]: the low end of each group's range
    times ratios[..., 0], the high end times ratios[..., 1]."""
    low, high = group_ranges(w, group_size)
    r_low, r_high = ratios[..., :1], ratios[..., 1:]
    groups = w.reshape(w.shape[0], -1, group_size)
    return torch.maximum(torch.minimum(groups, high * r_high), low * r_low).reshape(w.shape)


def clip_delta(w: torch.Tensor, ratios: torch.Tensor, group_size: int) -> torch.Tensor:
    """Q(w clipped to `ratios` [N, K // G, 2], as clipped's) − w [N, K] float32, Q the INT4 RTN in groups of G."""
    return dequantize_int4(quantize_int4(clipped(w, ratios, group_size), group_size)).float() - w


def row_errors(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """delta [N, K], gram xᵀx [K, K] → ‖x δ_nᵀ‖² of each row [N]."""
    return ((delta @ gram) * delta).sum(dim=1)


@torch.no_grad()
def search_clip(w: torch.Tensor, gram: torch.Tensor, group_size: int, max_rows: int = 4096) -> torch.Tensor:
    """w float32 [N, K] (the weight RTN will get), gram xᵀx [K, K] of its calibration inputs → ratios [N, K // G, 2],
    (r_low, r_high) of each group (module docstring)."""
    num_groups = w.shape[1] // group_size
    blocks = _gram_blocks(gram, group_size)
    ratios = torch.ones(w.shape[0], num_groups, 2, device=w.device)
    for start in range(0, w.shape[0], max_rows):
        rows = w[start:start + max_rows]  # [R, K]
        ratios[start:start + max_rows] = _search_rows(rows, gram, blocks, group_size)
    return ratios


def _gram_blocks(gram: torch.Tensor, group_size: int) -> torch.Tensor:
    """gram [K, K] → its diagonal blocks [K // G, G, G], one a group of G input columns."""
    return torch.stack([gram[g:g + group_size, g:g + group_size] for g in range(0, gram.shape[0], group_size)])


def _group_errors(w: torch.Tensor, candidate: torch.Tensor, blocks: torch.Tensor, group_size: int) -> torch.Tensor:
    """→ [R, K // G]: δ_g B_g δ_gᵀ of each group of w [R, K] clipped to `candidate` ratios."""
    grouped = clip_delta(w, candidate, group_size).reshape(w.shape[0], -1, group_size).transpose(0, 1)
    return (torch.bmm(grouped, blocks) * grouped).sum(dim=-1).T


def _search_rows(w: torch.Tensor, gram: torch.Tensor, blocks: torch.Tensor, group_size: int) -> torch.Tensor:
    """search_clip on one block of rows w [R, K] → ratios [R, K // G, 2] (low, high)."""
    best_error = torch.full((w.shape[0], blocks.shape[0]), float("inf"), device=w.device)  # [R, K // G]
    best = torch.ones(*best_error.shape, 2, device=w.device)
    passes = ([(ratio, ratio) for ratio in CLIP_RATIOS] + [(ratio, None) for ratio in CLIP_RATIOS]
              + [(None, ratio) for ratio in CLIP_RATIOS])
    for low, high in passes:  # symmetric ratios, then each end alone with the other end at its best so far
        candidate = best.clone()
        if low is not None:
            candidate[..., 0] = low
        if high is not None:
            candidate[..., 1] = high
        error = _group_errors(w, candidate, blocks, group_size)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better[..., None], candidate, best)
    chosen, plain = clip_delta(w, best, group_size), clip_delta(w, torch.ones_like(best), group_size)  # [R, K]
    worse = row_errors(chosen, gram) > row_errors(plain, gram)  # [R]
    best[worse] = 1.0
    return best


def _fp16_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales [...] as the checkpoint's fp16 holds them (back in float32), never 0."""
    return scales.half().float().clamp(min=2.0 ** -24)


def _grid_errors(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, blocks: torch.Tensor
                 ) -> torch.Tensor:
    """groups w [R, K // G, G] on the grids (scales, zeros) [R, K // G] → δ_g B_g δ_gᵀ of each group [R, K // G]."""
    q = round_on_grid(groups, scales[..., None], zeros[..., None])
    delta = ((q - zeros[..., None]) * scales[..., None] - groups).transpose(0, 1)  # [K // G, R, G]
    return (torch.bmm(delta, blocks) * delta).sum(dim=-1).T


@torch.no_grad()
def search_grid(w: torch.Tensor, gram: torch.Tensor, group_size: int, max_rows: int = 4096
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """w float32 [N, K], gram [K, K] of its calibration inputs (shrunk_gram's) → (scales, zeros) [N, K // G] float32
    each, the INT4 grid of each group: search_clip's ratios, then the refinement over GRID_FACTORS and ZERO_STEPS
    (module docstring); scales fp16-exact. A row whose whole-row error came out worse than plain RTN's keeps RTN's
    grid."""
    num_groups = w.shape[1] // group_size
    blocks = _gram_blocks(gram, group_size)
    ratios = search_clip(w, gram, group_size, max_rows)
    plain = quantize_int4(w, group_size)
    plain_scales, plain_zeros = _fp16_scales(plain.scales), plain.zeros.float()
    clip = quantize_int4(clipped(w, ratios, group_size), group_size)
    base_scales, base_zeros = _fp16_scales(clip.scales), clip.zeros.float()  # [N, K // G]
    scales, zeros = base_scales.clone(), base_zeros.clone()
    for start in range(0, w.shape[0], max_rows):
        rows = slice(start, start + max_rows)
        groups = w[rows].reshape(-1, num_groups, group_size)  # [R, K // G, G]
        best_error = torch.full(groups.shape[:2], float("inf"), device=w.device)
        for factor in GRID_FACTORS:
            for step in ZERO_STEPS:
                s, z = _fp16_scales(base_scales[rows] * factor), (base_zeros[rows] + step).clamp(0, 15)
                error = _grid_errors(groups, s, z, blocks)
                better = error < best_error
                best_error = torch.where(better, error, best_error)
                scales[rows], zeros[rows] = torch.where(better, s, scales[rows]), torch.where(better, z, zeros[rows])
    chosen = dequantize_int4(quantize_int4_on(w, scales, zeros, group_size)).float() - w
    rtn = dequantize_int4(quantize_int4_on(w, plain_scales, plain_zeros, group_size)).float() - w
    worse = row_errors(chosen, gram) > row_errors(rtn, gram)  # [N]
    scales[worse], zeros[worse] = plain_scales[worse], plain_zeros[worse]
    return scales, zeros

