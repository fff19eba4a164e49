"""Shared helpers of the kernel tests: the device, the error measure, random paged-cache layouts."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; a NaN anywhere (e.g. an unwritten poisoned element) fails."""
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def randn(shape, gen: torch.Generator, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=device)


def random_paged_cache(seq_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: str, gen: torch.Generator):
    """K/V caches with each sequence's pages scattered at random (page 0 left as padding).

    Returns (k_cache, v_cache [P, S, KVH, D], page_table [B, max_pages] int32, seq_lens [B] int32)."""
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(shape, gen, dtype, device), randn(shape, gen, dtype, device)
    table = torch.zeros((len(seq_lens), max(pages_per_seq)), dtype=torch.int32)
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return k_cache, v_cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)



def assert_switch_keeps_every_bit(loaded, field: str, check) -> None:
    """Six prompts of 20-85 tokens → 24 greedy tokens each with 2 logprobs, on a qwen3-0.6b engine of 8 sequences and
    64-token steps (graph steps of several batch sizes, eager mixed steps), with EngineConfig.<field> "off" and then
    "on": the very same tokens and logprobs. check(engine, mode) asserts that the switch took effect."""
    from services.gpu_worker.engine import Engine
    from services.gpu_worker.engine_config import EngineConfig
    from services.gpu_worker.request import SamplingParams

    prompts = [[(i * 37 + j * 11) % loaded.config.vocab_size for j in range(20 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for mode in ("off", "on"):
        engine = Engine(EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16", num_pages=512,
                                     max_num_seqs=8, max_num_batched_tokens=64, **{field: mode}), loaded=loaded)
        check(engine, mode)
        results = [r.samples[0] for r in engine.generate(prompts, params)]
        assert engine.graphs.num_replays > 0
        runs.append(([s.token_ids for s in results], [[lp.logprob for lp in s.logprobs] for s in results]))
    assert runs[0] == runs[1]
