"""The decode kernel's splits follow each sequence's keys (decode_attention.split_plan): one per MIN_SPLIT_KEYS keys up
to the launch's split count. Mixed lengths in one launch (at multiples of the split size and one either side, with and
without a window, V in key pairs with odd window starts) match the reference; a split a sequence does not use loads
and stores nothing, and the reduce merges the used splits alone, so partial buffers poisoned with NaN stay out of the
output; a sequence of one used split is written by the split kernel itself."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention.base import LayerAttention
from services.gpu_worker.kernels import decode_attention as da
from services.gpu_worker.kernels.kv_write import kv_write_ref
from services.gpu_worker.kernels.rope import rope_ref
from services.gpu_worker.kv_cache import v_rows
from tests.kernels.helpers import DEVICE, randn, random_paged_cache, rel_err
from tests.kernels.test_decode_attention import _new_token_step

PAGE = 4
SPLITS = 8
TILE16 = (16, 4, 2, False, 0)  # 16-key tiles: a split of 16 keys is one tile
# one key; around multiples of 16 keys; 8 splits of 16; 132 keys: 8 of 17 rounded up to whole tiles, 5 splits of 32
SEQ_LENS = [1, 15, 16, 17, 31, 32, 33, 128, 132]
FP8 = torch.float8_e4m3fn


def used_splits(seq_len: int, num_splits: int, min_keys: int, block_n: int, window: int = 0,
                pairs: bool = False) -> int:
    """split_plan's `used` on the host: the splits that hold a key of the sequence."""
    base = 0
    if window:
        lo = max(seq_len - window, 0)
        base = lo - lo % 2 if pairs else lo
    keys = seq_len - base
    want = min(-(-keys // min_keys), num_splits)
    chunk = -(-(-(-keys // want)) // block_n) * block_n
    return -(-keys // chunk)


@pytest.fixture
def poisoned(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The partial buffers of every launch, filled with NaN first: a row the split kernel did not write stays NaN, and
    a reduce that merged it would put NaN into the output."""
    made = []
    empty = da.partials

    def partials(*args):
        part, lse = (t.fill_(float("nan")) for t in empty(*args))
        made.append((part, lse))
        return part, lse

    monkeypatch.setattr(da, "partials", partials)
    return made


def _check_partials(made, seq_lens, num_heads, min_keys, block_n, window=0, pairs=False) -> None:
    """Each sequence's rows of splits < used written (finite), the rest left NaN; none for a sequence of one split."""
    (part, lse), = made
    for b, seq_len in enumerate(seq_lens):
        used = used_splits(seq_len, SPLITS, min_keys, block_n, window, pairs)
        written = used if used > 1 else 0
        assert not lse[b, :, :written].isnan().any() and lse[b, :, written:].isnan().all(), (seq_len, used)
        assert not part[b, :, :written].isnan().any() and part[b, :, written:].isnan().all(), (seq_len, used)
    assert lse.shape == (len(seq_lens), num_heads, SPLITS)


def test_the_host_mirror_of_the_plan_cuts_into_whole_tiles():
    """used_splits: one split per 16 keys up to 8; whole 64-key tiles give fewer; with a window, its keys count (from
    an even key where V is in pairs)."""
    assert [used_splits(n, 8, 16, 16) for n in SEQ_LENS] == [1, 1, 1, 2, 2, 2, 3, 8, 5]
    assert [used_splits(n, 8, 16, 64) for n in (64, 65, 130, 1000)] == [1, 2, 3, 8]
    assert used_splits(130, 8, 16, 16, window=37) == 3 and used_splits(131, 8, 16, 16, window=37, pairs=True) == 3
    assert used_splits(1000, 8, 256, 64) == 4 and used_splits(256, 32, 256, 128) == 1


@pytest.mark.parametrize("window", [0, 37], ids=["full", "window37"])
def test_mixed_lengths_match_the_reference_and_merge_only_the_used_splits(poisoned, window):
    spec = LayerAttention(softcap=1.5, sliding_window=window or None)
    gen = torch.Generator().manual_seed(window)
    seq_lens = SEQ_LENS + [window, window + 1, window + 16] if window else SEQ_LENS
    k, v, table, lens = random_paged_cache(seq_lens, PAGE, 2, 16, torch.float32, DEVICE, gen)
    q = randn((len(seq_lens), 4, 16), gen, torch.float32, DEVICE, scale=2.0)
    out = torch.full_like(q, float("nan"))
    da.decode_attention(q, k, v, table, lens, SPLITS, out=out, tile=TILE16, spec=spec, min_split_keys=16)
    assert rel_err(out, da.decode_attention_ref(q, k, v, table, lens, spec)) < 2e-5
    _check_partials(poisoned, seq_lens, 4, 16, 16, window)


@pytest.mark.parametrize("window", [37, 36, 1])  # odd and even window starts at 130, 131 and 38 keys
def test_fp8_pairs_with_a_window_split_from_an_even_key(poisoned, window):
    spec = LayerAttention(sliding_window=window)
    seq_lens = [5, 37, 38, 130, 131]
    gen = torch.Generator().manual_seed(window)
    k, v, table, lens = random_paged_cache(seq_lens, PAGE, 2, 16, torch.float32, DEVICE, gen)
    k, v = k.to(FP8), v.to(FP8)
    q = randn((len(seq_lens), 4, 16), gen, torch.float32, DEVICE, scale=2.0)
    out = da.decode_attention(q, k, v, table, lens, SPLITS, tile=TILE16, spec=spec, min_split_keys=8)
    assert rel_err(out, da.decode_attention_ref(q, k.float(), v_rows(v).float(), table, lens, spec)) < 2e-3
    _check_partials(poisoned, seq_lens, 4, 8, 16, window, pairs=True)


@pytest.mark.parametrize("min_keys", [1, 16, 10 ** 6], ids=["every_split", "per_16_keys", "one_split"])
def test_rope_step_writes_the_new_token_from_the_one_split_that_owns_it(poisoned, monkeypatch, min_keys):
    """decode_attention_rope with MIN_SPLIT_KEYS set on the module (the default of min_split_keys): the new k and v
    land in their slots (exactly one split owns position seq_len - 1), every other slot is untouched, and the output
    is the reference's: from partials where a sequence uses several splits, from the split kernel where it uses one
    (10⁶ keys: every sequence, so no partial row is written)."""
    monkeypatch.setattr(da, "MIN_SPLIT_KEYS", min_keys)
    q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens = _new_token_step(
        SEQ_LENS, 4, 2, 16, PAGE, torch.float32, min_keys)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = rope_ref(q, k, positions, inv_freq)
    kv_write_ref(ref_k, v, ref_k_cache, ref_v_cache, slots)
    out = torch.full_like(q, float("nan"))
    da.decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots.to(torch.int32), table, lens,
                             SPLITS, out=out, tile=TILE16)
    assert rel_err(out, da.decode_attention_ref(ref_q, ref_k_cache, ref_v_cache, table, lens)) < 2e-5
    assert torch.equal(v_cache, ref_v_cache) and rel_err(k_cache, ref_k_cache) < 1e-6
    _check_partials(poisoned, SEQ_LENS, 4, min_keys, 16)


@pytest.mark.skipif(DEVICE == "cuda", reason="counts the interpreter's calls")
def test_a_split_past_the_keys_loads_nothing(monkeypatch):
    """Every program that goes on past split_plan rotates q and k (two _rotate_row calls); a split ≥ used returns
    before: 2 · KVH · Σ used calls, not 2 · KVH · B · NUM_SPLITS."""
    calls = []
    rotate = da._rotate_row

    def counting(*args):
        calls.append(1)
        return rotate(*args)

    monkeypatch.setattr(da, "_rotate_row", counting)
    q, k, v, positions, inv_freq, k_cache, v_cache, slots, table, lens = _new_token_step(
        SEQ_LENS, 4, 2, 16, PAGE, torch.float32, 0)
    da.decode_attention_rope(q, k, v, positions, inv_freq, k_cache, v_cache, slots.to(torch.int32), table, lens,
                             SPLITS, tile=TILE16, min_split_keys=16)
    assert len(calls) == 2 * 2 * sum(used_splits(n, SPLITS, 16, 16) for n in SEQ_LENS) == 2 * 2 * 25
