"""EngineConfig's device defaults: batching limits chosen from the device and the KV pool when unset."""
from __future__ import annotations

import pytest

from radixserve.cli import build_parser
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.engine_config import BatchingLimits, EngineConfig


def test_cpu_keeps_small_steps() -> None:
    limits = EngineConfig(device="cpu").resolved_batching(num_pages=100_000)
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (512, 256)
    assert "CPU default" in limits.reason


@pytest.mark.parametrize(("num_pages", "expected_seqs"), [
    (54_000, 416),  # an H200's bf16 pool for Llama-3.1-8B: 863,984 tokens hold 421 sequences of 2048 tokens
    (108_000, 832),  # the same pool in FP8: twice the tokens
    (1_000_000, 1024),  # capped
    (100, 16),  # floored: a tiny pool still batches
])
def test_cuda_sizes_sequences_from_the_pool(num_pages: int, expected_seqs: int) -> None:
    limits = EngineConfig(device="cuda").resolved_batching(num_pages)
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (8192, expected_seqs)
    assert f"max_num_seqs {expected_seqs}" in limits.reason and "8192" in limits.reason


def test_set_values_win_on_any_device() -> None:
    config = EngineConfig(device="cuda", max_num_batched_tokens=1024, max_num_seqs=64)
    assert config.resolved_batching(54_000) == BatchingLimits(1024, 64, "both set by the config")


def test_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_serve_and_the_worker_leave_the_limits_to_the_device() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.max_num_batched_tokens, args.max_num_seqs) == (0, 0)
    engine_config = WorkerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                 max_num_seqs=args.max_num_seqs).engine_config()
    assert (engine_config.max_num_batched_tokens, engine_config.max_num_seqs) == (None, None)
    set_config = WorkerConfig(max_num_batched_tokens=2048, max_num_seqs=32).engine_config()
    assert (set_config.max_num_batched_tokens, set_config.max_num_seqs) == (2048, 32)


def test_admission_in_batches_is_on_where_decode_steps_replay_cuda_graphs() -> None:
    assert EngineConfig().resolved_min_admit_batch(has_cuda_graphs=True) == 16
    assert EngineConfig().resolved_min_admit_batch(has_cuda_graphs=False) == 1  # every CPU step is eager anyway
    assert EngineConfig(min_admit_batch=4).resolved_min_admit_batch(has_cuda_graphs=False) == 4
    with pytest.raises(ValueError):
        EngineConfig(max_admit_delay_steps=-1)


def test_the_checkpoint_copy_is_freed_before_the_pool_is_sized(monkeypatch) -> None:
    """An engine that loads its own weights drops the loader's copy once they are in the model, before it sizes the
    KV pool from free memory (with it alive, the pool lost a whole second copy of the weights); a caller's
    LoadedModel is left as it was."""
    from services.gpu_worker import engine as engine_module
    from services.gpu_worker import model_runner
    from services.gpu_worker.model.loader import load_model

    loads, entries_at_sizing = [], []
    real_num_pages = EngineConfig.resolved_num_pages

    def loading(*args, **kwargs):
        loads.append(load_model(*args, **kwargs))
        return loads[-1]

    def sizing(self, *args, **kwargs):
        entries_at_sizing.append(sum(len(loaded.state_dict) for loaded in loads))
        return real_num_pages(self, *args, **kwargs)

    monkeypatch.setattr(model_runner, "load_model", loading)
    monkeypatch.setattr(EngineConfig, "resolved_num_pages", sizing)
    config = EngineConfig(model="random:tiny-llama", device="cpu", num_pages=32)
    engine_module.Engine(config)
    assert len(loads) == 1 and entries_at_sizing == [0]
    given = load_model("random:tiny-llama")
    engine_module.Engine(config, loaded=given)
    assert given.state_dict  # not the engine's to clear
