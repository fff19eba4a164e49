"""Soft-capped and sliding-window attention (a layer's LayerAttention: Gemma 2) on the decode and extend kernels vs
their fp32 references: each alone and both, a window past the context and one inside a page, split-K decode with
the window starting mid-sequence, the RoPE-fused decode, FP8 caches (V in key pairs, odd and even window starts);
and the windowed kernels read no key tile wholly before the window."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.base import LayerAttention
from services.gpu_worker.kernels import paging
from services.gpu_worker.kernels.decode_attention import decode_attention, decode_attention_ref, decode_attention_rope
from services.gpu_worker.kernels.extend_attention import extend_attention, extend_attention_ref
from services.gpu_worker.kernels.kv_write import kv_write_ref
from services.gpu_worker.kernels.rope import rope_ref
from services.gpu_worker.kv_cache import v_rows
from tests.kernels.helpers import DEVICE, randn, random_paged_cache, rel_err
from tests.kernels.test_decode_attention import _new_token_step

FP8 = torch.float8_e4m3fn
PAGE = 4
SPECS = {
    "cap": LayerAttention(softcap=1.5),
    "window": LayerAttention(sliding_window=37),
    "both": LayerAttention(scale=0.3, softcap=1.5, sliding_window=37),
    "window_past_context": LayerAttention(softcap=1.5, sliding_window=1000),
    "window_in_a_page": LayerAttention(sliding_window=3),
    "window_of_one": LayerAttention(sliding_window=1),
}
TILE16 = (16, 4, 2, False, 0)  # 16-key tiles: a window spans several, and the splits start inside it


def _q(shape, gen) -> torch.Tensor:
    return randn(shape, gen, torch.float32, DEVICE, scale=2.0)  # logits of a few units: the cap bends them


def _shows(out: torch.Tensor, plain: torch.Tensor) -> None:
    """The variant changes the result (else the comparison above it proves nothing about the variant)."""
    assert rel_err(out, plain) > 0.05


@pytest.mark.parametrize("tile", [None, TILE16], ids=["tile64", "tile16"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_decode(name, num_splits, tile):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(num_splits)
    k, v, table, lens = random_paged_cache([1, 5, 38, 130], PAGE, 2, 16, torch.float32, DEVICE, gen)
    q = _q((4, 4, 16), gen)
    out = decode_attention(q, k, v, table, lens, num_splits, tile=tile, spec=spec)
    assert rel_err(out, decode_attention_ref(q, k, v, table, lens, spec)) < 2e-5
    _shows(out, decode_attention_ref(q, k, v, table, lens))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("name", ["both", "window_in_a_page", "window_of_one"])
def test_decode_rope(name, num_splits):
    """The new token comes from registers and the cached keys end one before it: a window of one sees it alone."""
    spec = SPECS[name]
    q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens = _new_token_step(
        [1, 6, 38, 130], 4, 2, 16, PAGE, torch.float32, num_splits)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    kv_write_ref(ref_k, v, ref_k_cache, ref_v_cache, slots)
    out = decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots.to(torch.int32), table, lens,
                                num_splits, tile=TILE16, spec=spec)
    assert rel_err(out, decode_attention_ref(ref_q, ref_k_cache, ref_v_cache, table, lens, spec)) < 2e-5
    assert torch.equal(v_cache, ref_v_cache)  # the new token's v written by the split that owns it
    _shows(out, decode_attention_ref(ref_q, ref_k_cache, ref_v_cache, table, lens))


# cached prefixes and chunks, a one-token decode among them, a whole prompt; 16-query blocks
EXTEND_BATCH = ([40, 9, 23, 60], [5, 9, 1, 60])


@pytest.mark.parametrize("name", list(SPECS))
def test_extend(name):
    spec = SPECS[name]
    seq_lens, new_lens = EXTEND_BATCH
    gen = torch.Generator().manual_seed(3)
    k, v, table, lens = random_paged_cache(seq_lens, PAGE, 2, 16, torch.float32, DEVICE, gen)
    query_start = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    q = _q((sum(new_lens), 4, 16), gen)
    out = extend_attention(q, k, v, query_start, lens, table, max(new_lens), 16, 16, spec=spec)
    assert rel_err(out, extend_attention_ref(q, k, v, query_start, lens, table, spec)) < 2e-5
    _shows(out, extend_attention_ref(q, k, v, query_start, lens, table))


@pytest.mark.parametrize("window", [37, 36, 3, 1])  # odd and even window starts at 130 and 38 keys
def test_fp8_cache(window):
    """V in key pairs: an odd first window key shares its word with the key before it, which stays out."""
    spec = LayerAttention(softcap=1.5, sliding_window=window)
    gen = torch.Generator().manual_seed(window)
    k, v, table, lens = random_paged_cache([5, 37, 38, 130], PAGE, 2, 16, torch.float32, DEVICE, gen)
    k, v = k.to(FP8), v.to(FP8)
    k_ref, v_ref = k.float(), v_rows(v).float()
    q = _q((4, 4, 16), gen)
    for num_splits in (1, 4):
        out = decode_attention(q, k, v, table, lens, num_splits, tile=TILE16, spec=spec)
        assert rel_err(out, decode_attention_ref(q, k_ref, v_ref, table, lens, spec)) < 2e-3
    query_start = torch.tensor([0, 2, 5, 6, 26], dtype=torch.int32, device=DEVICE)
    qe = _q((26, 4, 16), gen)
    out = extend_attention(qe, k, v, query_start, lens, table, 20, 16, 16, spec=spec)
    assert rel_err(out, extend_attention_ref(qe, k_ref, v_ref, query_start, lens, table, spec)) < 2e-3


def test_fp8_decode_rope_window_of_one():
    """Odd and even sequence lengths with the new token alone in its window: no cached key (nor its pair) counts,
    so each head's output is the new v as its split stored it in the cache."""
    spec = LayerAttention(softcap=1.5, sliding_window=1)
    q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens = _new_token_step(
        [2, 7, 38, 131], 4, 2, 16, PAGE, torch.float32, 9)
    k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
    out = decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots.to(torch.int32), table, lens,
                                4, tile=TILE16, spec=spec)
    stored = v_rows(v_cache).view(-1, 2, 16)[slots].float()  # [B, KVH, D]
    assert torch.equal(out, stored.repeat_interleave(2, dim=1))


def _tiles_read(monkeypatch) -> list[tuple[int, int]]:
    """(first, last) key of every key tile a kernel looks up in the page table (paging.slot_of), interpreter only."""
    tiles: list[tuple[int, int]] = []
    slot_of = paging.slot_of

    def recording(table_row_ptr, key, mask, page_size, off64):
        keys = key.handle.data
        tiles.append((int(keys.min()), int(keys.max())))
        return slot_of(table_row_ptr, key, mask, page_size, off64)

    monkeypatch.setattr(paging, "slot_of", recording)
    return tiles


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's page-table lookups")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_windowed_decode_reads_only_the_windows_tiles(monkeypatch, num_splits):
    """130 keys, a window of 37 (keys 93..129): every tile read holds a key of it, and together they cover it."""
    tiles = _tiles_read(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    k, v, table, lens = random_paged_cache([130], PAGE, 1, 16, torch.float32, DEVICE, gen)
    q = _q((1, 2, 16), gen)
    decode_attention(q, k, v, table, lens, num_splits, tile=TILE16, spec=LayerAttention(sliding_window=37))
    assert tiles and all(last >= 93 for _, last in tiles)
    assert min(first for first, _ in tiles) <= 93 and sum(last - first + 1 for first, last in tiles) < 2 * 37
    tiles.clear()
    decode_attention(q, k, v, table, lens, num_splits, tile=TILE16)
    assert min(first for first, _ in tiles) == 0  # without a window: from key 0


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's page-table lookups")
def test_windowed_extend_reads_only_the_blocks_windows_tiles(monkeypatch):
    """A 64-token prompt in 16-query blocks, a window of 10: block m (queries 16m..16m+15) reads keys from 16m - 9
    on, never a tile wholly before that."""
    tiles = _tiles_read(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    k, v, table, lens = random_paged_cache([64], PAGE, 1, 16, torch.float32, DEVICE, gen)
    query_start = torch.tensor([0, 64], dtype=torch.int32, device=DEVICE)
    extend_attention(_q((64, 1, 16), gen), k, v, query_start, lens, table, 64, 16, 16,
                     spec=LayerAttention(sliding_window=10))
    assert sorted({first for first, _ in tiles}) == [0, 7, 23, 39, 55]  # from max(16m - 9, 0), 16 keys a step
