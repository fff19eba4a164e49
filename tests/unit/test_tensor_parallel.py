"""Tensor parallelism on the CPU: 2 spawned ranks over gloo compute what one rank computes.

(a) the sharded model's logits equal the whole model's on mixed prefill/decode batches; (b) the lockstep
engine's tokens equal a single-rank engine's through batching, chunked prefill, prefix-cache hits,
preemption, aborts and sampling; (c) head counts that tp does not divide are refused with a clear error.
"""
from __future__ import annotations

import random

import pytest
import torch

from services.gpu_worker.attention import AttentionMetadata, TorchAttention
from services.gpu_worker.block_pool import BlockPool
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.model.llama import LlamaForCausalLM
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.model.presets import preset
from services.gpu_worker.parallel import (LockstepEngine, TensorParallelDivergence, check_tensor_parallel,
                                          current_group, follow, launch, shard_state_dict)
from services.gpu_worker.parallel.state import TensorParallelGroup
from services.gpu_worker.parallel.lockstep_cache import LockstepRadixCache
from services.gpu_worker.request import SamplingParams

TP = 2
PAGE = 4
SEED = 1  # the random weights'
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)

# (page ids, first new position, end) per sequence per step: A, B, D prefill (D only a first chunk), then a
# mixed step (A, B decode; C prefills; D's second chunk), then a decode-only step.
_STEPS = [
    [([1, 2, 3, 4], 0, 10), ([5, 6, 7, 8], 0, 6), ([13, 14, 15, 16], 0, 8)],
    [([1, 2, 3, 4], 10, 11), ([5, 6, 7, 8], 6, 7), ([9, 10, 11, 12], 0, 8), ([13, 14, 15, 16], 8, 13)],
    [([1, 2, 3, 4], 11, 12), ([5, 6, 7, 8], 7, 8), ([9, 10, 11, 12], 8, 9), ([13, 14, 15, 16], 13, 14)],
]


def _model_logits(preset_name: str, tp: TensorParallelGroup | None) -> list[torch.Tensor]:
    """The logits of every token of each of _STEPS ([T, V] per step), on a fresh paged cache."""
    loaded = load_model(f"random:{preset_name}", dtype=torch.float32, seed=SEED)
    cfg = loaded.config
    model = LlamaForCausalLM(cfg, tp)
    model.load_weights(loaded.state_dict)
    model.eval()
    kv_heads = cfg.num_kv_heads // (1 if tp is None else tp.size)
    cache = KVCache(cfg.num_layers, 17, PAGE, kv_heads, cfg.head_dim, torch.float32, "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))  # [seqs, pos]
    seq_of_pages = {1: 0, 5: 1, 9: 2, 13: 3}
    logits = []
    for step in _STEPS:
        ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for pages, start, end in step:
            ids += tokens[seq_of_pages[pages[0]], start:end].tolist()
            positions += range(start, end)
            slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, end)]
            query_start.append(query_start[-1] + end - start)
            seq_lens.append(end)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start=torch.tensor(query_start, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            page_table=torch.tensor([pages for pages, _, _ in step], dtype=torch.int32),
            query_start_host=query_start, seq_lens_host=seq_lens,
            max_query_len=max(end - start for _, start, end in step), max_seq_len=max(seq_lens))
        hidden = model(torch.tensor(ids), torch.tensor(positions), cache, meta, TorchAttention())
        logits.append(model.logits(hidden))
    return logits


def _rank_model_logits(preset_name: str) -> list[list]:
    return [step.tolist() for step in _model_logits(preset_name, current_group(TP))]  # MessagePack types


@pytest.mark.slow
# GQA; q/k/v bias; qk-norm; routed experts (each rank its share of every expert) beside a dense MLP
@pytest.mark.parametrize("preset_name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
def test_sharded_forward_equals_the_whole_model(preset_name: str) -> None:
    expected = _model_logits(preset_name, None)
    got = [torch.tensor(step) for step in launch(TP, _rank_model_logits, preset_name)]
    assert [t.shape for t in got] == [t.shape for t in expected]
    for step_got, step_expected in zip(got, expected, strict=True):
        torch.testing.assert_close(step_got, step_expected, rtol=0.0, atol=1e-4)


def test_shards_partition_the_weights() -> None:
    cfg = preset("tiny-llama")
    full = load_model("random:tiny-llama", seed=SEED).state_dict
    shards = [shard_state_dict(full, cfg, rank, TP) for rank in range(TP)]
    layer = "model.layers.1."
    for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("self_attn.o_proj.weight", 1),
                      ("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0), ("mlp.down_proj.weight", 1)):
        parts = [shard[layer + name] for shard in shards]
        assert all(p.shape[dim] == full[layer + name].shape[dim] // TP for p in parts)
        assert torch.equal(torch.cat(parts, dim=dim), full[layer + name])
    for name in ("model.embed_tokens.weight", "lm_head.weight", layer + "input_layernorm.weight"):
        assert all(shard[name] is full[name] for shard in shards)


def test_expert_shards_partition_each_experts_intermediate() -> None:
    cfg = preset("tiny-qwen3-moe")
    full = load_model("random:tiny-qwen3-moe", seed=SEED).state_dict
    shards = [shard_state_dict(full, cfg, rank, TP) for rank in range(TP)]
    gate_up, down = full["model.layers.0.mlp.experts.gate_up_proj"], full["model.layers.0.mlp.experts.down_proj"]
    inter = cfg.moe_intermediate_size
    gates = [shard["model.layers.0.mlp.experts.gate_up_proj"][:, : inter // TP] for shard in shards]
    ups = [shard["model.layers.0.mlp.experts.gate_up_proj"][:, inter // TP:] for shard in shards]
    assert torch.equal(torch.cat(gates, dim=1), gate_up[:, :inter]) and torch.equal(torch.cat(ups, dim=1),
                                                                                    gate_up[:, inter:])
    assert torch.equal(torch.cat([shard["model.layers.0.mlp.experts.down_proj"] for shard in shards], dim=2), down)
    assert all(shard["model.layers.0.mlp.gate.weight"] is full["model.layers.0.mlp.gate.weight"] for shard in shards)
    assert all(shard["model.layers.1.mlp.gate_proj.weight"].shape[0] == cfg.intermediate_size // TP
               for shard in shards)  # the dense layer as in a dense model


def test_the_lockstep_cache_stamps_rank_0s_clock_not_its_own() -> None:
    pool = BlockPool(8)
    cache = LockstepRadixCache(pool, PAGE, "random:tiny-llama")
    cache.pin_clock(5.0)
    node = cache.insert(list(range(8)), pool.allocate(2), now=123.0).node  # this rank's own clock: ignored
    assert node.last_access == 5.0
    cache.pin_clock(7.0)
    assert cache.match_prefix(list(range(8)), now=999.0).node.last_access == 7.0


def _engine_config(preset_name: str, tensor_parallel_size: int, overlap: bool = False) -> EngineConfig:
    # A small pool (preemption, eviction) and an 8-token step budget (chunked prefill).
    return EngineConfig(model=f"random:{preset_name}", device="cpu", dtype="float32", page_size=PAGE, num_pages=16,
                        max_num_batched_tokens=8, tensor_parallel_size=tensor_parallel_size, enable_overlap=overlap)


def _drive(engine: Engine | LockstepEngine) -> dict:
    """Batched + chunked greedy prompts sharing a prefix, the same again (cache hits), then requests joining
    mid-flight with an abort, seeded n=2 sampling and an unseeded one (rank-consistent, not comparable)."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(13)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 24))] for _ in range(6)]
    record: dict = {"rounds": []}
    for _ in range(2):
        results = engine.generate(prompts, GREEDY)
        record["rounds"].append([(r.num_cached_tokens, r.samples[0].token_ids,
                                  [lp.logprob for lp in r.samples[0].logprobs]) for r in results])
    streamed: dict[str, list[int]] = {}
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, n=2, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    engine.add_request("s0", prompts[0][:20], GREEDY)
    engine.add_request("s1", prompts[3], seeded)
    engine.add_request("s2", prompts[5], GREEDY)
    for num_steps in range(200):
        if num_steps == 3:
            engine.abort("s2")
            engine.add_request("s3", prompts[4][::-1], GREEDY)
            engine.add_request("u0", prompts[1], unseeded)
        outputs = engine.step()
        for out in outputs:
            streamed.setdefault(f"{out.request_id}/{out.index}", []).extend(out.token_ids)
            if out.finish_reason is not None:
                engine.release_finished(out.request_id)
        if not engine.has_unfinished():
            break
    record["streamed"] = {key: tokens for key, tokens in streamed.items() if not key.startswith("u0")}
    record["num_unseeded_tokens"] = len(streamed["u0/0"])
    stats = engine.stats()
    record["stats"] = [stats.num_steps, stats.num_preemptions, stats.num_cached_pages, stats.num_free_pages]
    return record


def lead_or_follow(engine: Engine, drive):
    """On rank 0, drive(LockstepEngine(engine)) and its result, the group shut down after; on the others, follow."""
    if engine.tp.rank != 0:
        follow(engine)
        return None
    lockstep = LockstepEngine(engine)
    try:
        return drive(lockstep)
    finally:
        assert lockstep.shutdown()


def _rank_drive(preset_name: str, overlap: bool) -> dict | None:
    return lead_or_follow(Engine(_engine_config(preset_name, TP, overlap),
                                 loaded=load_model(f"random:{preset_name}", seed=SEED)), _drive)


@pytest.mark.slow
@pytest.mark.parametrize(("preset_name", "overlap"), [("tiny-llama", False), ("tiny-qwen3", True),
                                                      ("tiny-qwen3-moe", True)])
def test_lockstep_engine_generates_what_one_rank_does(preset_name: str, overlap: bool) -> None:
    """overlap: the step mode of both sides (the CUDA default; its flush() travels to the followers)."""
    expected = _drive(Engine(_engine_config(preset_name, 1, overlap),
                             loaded=load_model(f"random:{preset_name}", seed=SEED)))
    got = launch(TP, _rank_drive, preset_name, overlap)
    for round_got, round_expected in zip(got["rounds"], expected["rounds"], strict=True):
        assert [(cached, tokens) for cached, tokens, _ in round_got] == [
            (cached, tokens) for cached, tokens, _ in round_expected]
        for (_, _, lp_got), (_, _, lp_expected) in zip(round_got, round_expected):
            assert lp_got == pytest.approx(lp_expected, abs=1e-4)
    assert sum(cached for cached, _, _ in got["rounds"][1]) > sum(cached for cached, _, _ in got["rounds"][0])
    assert got["streamed"] == expected["streamed"]
    assert got["num_unseeded_tokens"] == 6
    assert got["stats"] == expected["stats"]
    assert got["stats"][1] > 0  # the small pool preempted


def test_head_counts_tp_does_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        check_tensor_parallel(preset("tiny-smollm2"), 2)  # GQA with one kv head
    with pytest.raises(ValueError, match="num_heads=4"):
        check_tensor_parallel(preset("tiny-llama"), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(RuntimeError, match="joined no tensor-parallel group"):
        Engine(_engine_config("tiny-llama", TP))


def _rank_engine(preset_name: str) -> None:
    Engine(_engine_config(preset_name, TP))


@pytest.mark.slow
def test_an_engine_whose_heads_tp_does_not_divide_fails_on_every_rank() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide random:tiny-smollm2's num_kv_heads=1"):
        launch(TP, _rank_engine, "tiny-smollm2", timeout_s=60)


def _rank_diverge(preset_name: str) -> None:
    engine = Engine(_engine_config(preset_name, TP), loaded=load_model(f"random:{preset_name}", seed=SEED))
    if engine.tp.rank != 0:
        engine.eos_token_ids = frozenset(range(engine.model_config.vocab_size))  # ends every request at once
        follow(engine)
        return
    lockstep = LockstepEngine(engine)
    lockstep.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))


@pytest.mark.slow
def test_a_follower_that_diverges_stops_the_group() -> None:
    with pytest.raises(TensorParallelDivergence, match="rank 1: the outputs of step 1 differ from rank 0's"):
        launch(TP, _rank_diverge, "tiny-llama", timeout_s=60)
