"""The FP8 KV cache through the engine on the CPU (torch backend): config, pool sizing, writes, page copies, the
prefix cache, PD page export/import over shared memory and the stream backend's byte encoding. Every path must
carry the FP8 bytes unchanged: a request decoded from imported or cached pages gives the very tokens of one
computed from scratch on an FP8 engine."""
from __future__ import annotations

import random
import uuid

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.kv_cache import KVCache, v_pairs_of, v_rows
from services.gpu_worker.kv_transfer.export import export_pool
from services.gpu_worker.kv_transfer.shm import ShmPuller
from services.gpu_worker.kv_transfer.stream import _from_raw, _raw
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.model.presets import preset
from services.gpu_worker.request import SamplingParams

FP8 = torch.float8_e4m3fn
PAGE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(loaded, **overrides) -> Engine:
    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", page_size=PAGE,
                          kv_cache_dtype="fp8", **{"num_pages": 64, **overrides})
    return Engine(config, loaded=loaded)


@pytest.fixture(scope="module")
def loaded():
    return load_model("random:tiny-llama", dtype=torch.float32, seed=5)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(length)]


def test_config_choices_and_pool_sizing():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8").resolved_kv_dtype() == FP8
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_kv_dtype() == torch.bfloat16
    cfg = preset("tiny-llama")
    sizes = {kv: EngineConfig(device="cpu", kv_cache_bytes=1 << 24, kv_cache_dtype=kv, page_size=PAGE)
             for kv in ("auto", "fp8")}
    pages = {kv: c.resolved_num_pages(cfg, c.resolved_kv_dtype(), torch.device("cpu")) for kv, c in sizes.items()}
    assert pages["fp8"] == 4 * pages["auto"]  # fp32 model on the CPU: 4 bytes per element against 1


def test_cache_writes_torchs_cast_and_copies_pages_bytewise():
    kv = KVCache(2, 6, PAGE, 2, 8, FP8, "cpu")
    k, v = torch.randn(3, 2, 8) * 50, torch.randn(3, 2, 8)
    slots = torch.tensor([4, 5, 13])
    kv.write(1, slots, k, v)
    assert torch.equal(kv.k[1].view(-1, 2, 8)[slots].view(torch.uint8), k.to(FP8).view(torch.uint8))
    assert torch.equal(v_rows(kv.v[1]).view(-1, 2, 8)[slots].view(torch.uint8), v.to(FP8).view(torch.uint8))
    # V in key pairs: slot 13 (page 13 // PAGE, offset 13 % PAGE) is the high byte of its pair row
    pairs = kv.v[1].view(torch.uint8).view(6, PAGE // 2, 2, 8, 2)
    assert torch.equal(pairs[13 // PAGE, (13 % PAGE) // 2, :, :, 1], v[2].to(FP8).view(torch.uint8))
    kv.copy_pages([1, 3], [4, 5])
    assert torch.equal(kv.k[:, 4:6].view(torch.uint8), kv.k[:, [1, 3]].view(torch.uint8))
    assert KVCache.bytes_per_page(2, PAGE, 2, 8, FP8) * 2 == KVCache.bytes_per_page(2, PAGE, 2, 8, torch.bfloat16)


def test_stream_encoding_round_trips_fp8_pages():
    pages = (torch.randn(2, 3, PAGE, 2, 8) * 10).to(FP8)
    back = _from_raw(_raw(pages), FP8, tuple(pages.shape))
    assert back.dtype == FP8 and torch.equal(back.view(torch.uint8), pages.view(torch.uint8))


def test_prefix_cache_and_pd_import_give_the_tokens_of_a_cold_fp8_engine(loaded):
    cold = _engine(loaded, enable_prefix_cache=False)
    warm = _engine(loaded)
    prefill, decode = _engine(loaded), _engine(loaded)
    first = _prompt(30, 1)
    second = first[:22] + _prompt(9, 2)  # 5 full pages shared, then a partial one copied on write
    want = [r.samples[0].token_ids for r in cold.generate([first, second], GREEDY)]
    assert cold.kv.k.dtype == FP8 and cold.kv.k.any()
    got = [warm.generate([p], GREEDY)[0].samples[0].token_ids for p in (first, second)]
    assert got == want
    assert warm.stats().num_cached_pages > 0

    exported = export_pool(prefill.kv, "host", f"rs-test-{uuid.uuid4().hex[:8]}", "")
    try:
        assert exported.source.dtype == "float8_e4m3fn"
        prefill.add_request("a", second, GREEDY, is_prefill_only=True)
        while prefill.has_unfinished():
            prefill.step()
        (handoff,) = prefill.drain_handoffs()
        plan = decode.import_request("a", second, handoff.first_token, GREEDY)
        ShmPuller().pull(exported.source, "lease", handoff.page_ids, plan.page_ids, decode.kv)
        assert decode.finish_import("a", is_filled=True)
        tokens = [handoff.first_token]
        while decode.has_unfinished():
            tokens += [t for o in decode.step() for t in o.token_ids]
        assert tokens == want[1]
        full = len(second) // PAGE  # the last, partial page has the decoded tokens' K/V since
        k_pages, _ = prefill.export_pages(handoff.page_ids[:full])
        assert k_pages.dtype == FP8
        assert torch.equal(k_pages.view(torch.uint8), decode.kv.k[:, plan.page_ids[:full]].view(torch.uint8))
    finally:
        exported.close()


def test_worker_flag_reaches_the_engine_config_and_a_bad_value_is_refused():
    from services.gpu_worker.config import WorkerConfig

    assert WorkerConfig(kv_cache_dtype="fp8").engine_config().resolved_kv_dtype() == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8"):
        WorkerConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="page_size must be even"):
        WorkerConfig(kv_cache_dtype="fp8", page_size=15)
    assert WorkerConfig(page_size=15).page_size == 15  # a cache in the model's dtype keeps its rows


def test_v_key_pairs_round_trip_and_need_an_even_page():
    rows = (torch.randn(3, 2, 6, 2, 4) * 10).to(FP8)  # [L, P, S, KVH, D]
    pairs = v_pairs_of(rows)
    assert torch.equal(v_rows(pairs).view(torch.uint8), rows.view(torch.uint8))
    assert torch.equal(pairs.view(torch.uint8).view(3, 2, 3, 2, 4, 2)[2, 1, 2, :, :, 1],
                       rows.view(torch.uint8)[2, 1, 5])  # key 5: pair 2, odd byte
    wide = rows.float()
    assert v_rows(wide) is wide and v_pairs_of(wide) is wide  # not FP8: rows, as it is
    with pytest.raises(ValueError, match="even"):
        KVCache(1, 2, 5, 2, 4, FP8, "cpu")
