"""Quantized checkpoints under tensor parallelism: each rank takes its slice of every quantized layer with the scales
that belong to it (QuantizedLinear.shard, parallel/shard.py shard_linear_layers). The slices compute the whole
layer's numbers (column parallel: concatenated; row parallel: summed, as the all-reduce does), what cannot be split
is refused, and two gloo ranks serving an AWQ or GPTQ checkpoint generate what one rank does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.parallel import LockstepEngine, launch
from services.gpu_worker.parallel.shard import shard_linear_layers
from services.gpu_worker.quant.fp8 import quantize_weight_fp8
from services.gpu_worker.quant.int4 import quantize_int4
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.request import SamplingParams
from tests.unit.hf_checkpoints import random_prompts
from tests.unit.quant_checkpoints import tiny_dense_llama, write_quantized
from tests.unit.test_tensor_parallel import lead_or_follow

TP = 2
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)


def _layers(n: int = 24, k: int = 128, group_size: int = 32, bias: bool = False) -> dict[str, QuantizedLinear]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * k ** -0.5
    b = torch.randn(n, generator=gen) if bias else None
    return {"fp8": QuantizedLinear.fp8(*quantize_weight_fp8(weight), b),
            "int4": QuantizedLinear.int4(quantize_int4(weight, group_size), b)}


@pytest.mark.parametrize("method", ["fp8", "int4"])
def test_column_slices_concatenate_to_the_whole_layer(method: str) -> None:
    layer = _layers(bias=True)[method]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    slices = [layer.shard(rank, TP, 0) for rank in range(TP)]
    assert all((s.in_features, s.out_features) == (128, 12) for s in slices)
    torch.testing.assert_close(torch.cat([s(x) for s in slices], dim=-1), layer(x), rtol=0, atol=1e-6)


def test_row_slices_sum_to_the_whole_int4_layer() -> None:
    layer = _layers()["int4"]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    slices = [layer.shard(rank, TP, 1) for rank in range(TP)]
    assert all((s.in_features, s.out_features) == (64, 24) and s.scales.shape == (24, 2) for s in slices)
    torch.testing.assert_close(sum(s(x[:, r * 64:(r + 1) * 64]) for r, s in enumerate(slices)), layer(x),
                               rtol=0, atol=1e-5)


def test_row_slices_of_fp8_keep_every_rows_scale() -> None:
    """The e4m3 columns partition exactly and each slice keeps the whole per-row scale; the sum is the whole
    layer's up to each rank quantizing its own slice of x (W8A8's per-token scale over fewer columns)."""
    layer = _layers()["fp8"]
    slices = [layer.shard(rank, TP, 1) for rank in range(TP)]
    assert torch.equal(torch.cat([s.qweight.float() for s in slices], dim=1), layer.qweight.float())
    assert all(torch.equal(s.weight_scale, layer.weight_scale) for s in slices)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    got = sum(s(x[:, r * 64:(r + 1) * 64]) for r, s in enumerate(slices))
    assert (got - layer(x)).norm() / layer(x).norm() < 0.05


def test_an_act_order_permutation_splits_only_within_a_slice() -> None:
    layer = _layers()["int4"]
    within = torch.cat([torch.randperm(64, generator=torch.Generator().manual_seed(2)),
                        64 + torch.randperm(64, generator=torch.Generator().manual_seed(3))])
    permuted = QuantizedLinear.int4(layer.int4_weight().__class__(layer.qweight, layer.scales, layer.zeros, 32, within))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    slices = [permuted.shard(rank, TP, 1) for rank in range(TP)]
    torch.testing.assert_close(sum(s(x[:, r * 64:(r + 1) * 64]) for r, s in enumerate(slices)), permuted(x),
                               rtol=0, atol=1e-5)
    across = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    crossing = QuantizedLinear.int4(layer.int4_weight().__class__(layer.qweight, layer.scales, layer.zeros, 32,
                                                                 across))
    with pytest.raises(ValueError, match="act-order"):
        crossing.shard(0, TP, 1)


def test_what_cannot_be_split_is_refused() -> None:
    with pytest.raises(ValueError, match="bias"):
        _layers(bias=True)["int4"].shard(0, TP, 1)
    with pytest.raises(ValueError, match="whole-group"):
        _layers(k=96, group_size=32)["int4"].shard(0, TP, 1)  # 48 columns a rank: not whole groups of 32
    with pytest.raises(ValueError, match="no tensor-parallel split"):
        shard_linear_layers({"model.layers.0.mlp.experts.gate_up_proj": _layers()["int4"]}, 0, TP)
    names = {"model.layers.0.self_attn.q_proj": 0, "model.layers.0.self_attn.o_proj": 1,
             "model.layers.0.mlp.up_proj": 0, "model.layers.0.mlp.down_proj": 1}
    sliced = shard_linear_layers({name: _layers()["int4"] for name in names}, 1, TP)
    for name, dim in names.items():
        assert (sliced[name].out_features, sliced[name].in_features) == ((12, 128) if dim == 0 else (24, 64))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return tiny_dense_llama(str(tmp_path_factory.mktemp("tpq")))


def _config(model: str, tp_size: int) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", num_pages=128, page_size=4,
                        tensor_parallel_size=tp_size)


def _generate(engine: Engine | LockstepEngine) -> list:
    return [(r.samples[0].token_ids, [lp.logprob for lp in r.samples[0].logprobs])
            for r in engine.generate(random_prompts(256, num=4), GREEDY)]


def _rank_generate(model: str) -> list | None:
    return lead_or_follow(Engine(_config(model, TP)), _generate)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_two_ranks_serve_an_int4_checkpoint_as_one_does(dense_dir: Path, method: str) -> None:
    quantized, _ = write_quantized(dense_dir, dense_dir.parent / f"tp-{method}", method, 32)
    expected = _generate(Engine(_config(str(quantized), 1)))
    got = launch(TP, _rank_generate, str(quantized))
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
