"""One copy of the weights at load (services/gpu_worker/model/adopt.py): an engine that loads its own weights takes the
loader's tensors as its parameters instead of allocating a second set and copying into it (Qwen3-30B-A3B: 61 GB
loaded plus 61 GB allocated did not fit an 80 GB card), and its output is the copying engine's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.gpu_worker import model_runner
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.adopt import adopt_parameters_, move_buffers_, parameters_on_meta
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 8, 250, 1, 64, 12]]


def _engine_loading_itself(monkeypatch, model: str) -> tuple[Engine, set[int]]:
    """An engine that loads its own weights, and the storage addresses of the tensors its loader returned."""
    loaded_ptrs: set[int] = set()

    def loading(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        loaded_ptrs.update(t.untyped_storage().data_ptr() for t in loaded.state_dict.values())
        return loaded

    monkeypatch.setattr(model_runner, "load_model", loading)
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_pages=64)), loaded_ptrs


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3-moe"])
def test_an_engine_loading_its_own_weights_keeps_the_loaders_tensors(monkeypatch, model: str) -> None:
    engine, loaded_ptrs = _engine_loading_itself(monkeypatch, model)
    params = dict(engine.model.named_parameters())
    assert params and not any(p.is_meta for p in params.values())
    not_adopted = [name for name, p in params.items() if p.untyped_storage().data_ptr() not in loaded_ptrs]
    assert not not_adopted, f"copied, not adopted: {not_adopted[:5]}"
    assert engine.model.inv_freq.dtype == torch.float32 and engine.model.inv_freq.device.type == "cpu"


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3-moe"])
def test_adopted_weights_give_the_copied_weights_greedy_output(monkeypatch, model: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    copying = Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_pages=64),
                     loaded=load_model(model, seed=0))
    adopting, _ = _engine_loading_itself(monkeypatch, model)
    assert ([r.samples[0] for r in adopting.generate(PROMPTS, params)]
            == [r.samples[0] for r in copying.generate(PROMPTS, params)])


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(3, 2, bias=True)
        self.register_buffer("scale", torch.arange(3, dtype=torch.float32), persistent=False)


def test_building_on_meta_allocates_no_parameter_and_keeps_buffers() -> None:
    with parameters_on_meta():
        model = _Two()
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model.scale, torch.arange(3, dtype=torch.float32))  # a buffer's value survives
    move_buffers_(model, torch.device("cpu"))
    assert not model.scale.is_meta
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch ends with the block


def test_only_whole_tensors_of_the_right_kind_are_adopted() -> None:
    """A view (a tensor-parallel slice), a tensor in another dtype or of another shape gets memory of its own for the
    load to copy into: adopting a slice would keep its whole tensor alive."""
    with parameters_on_meta():
        model = _Two()
    whole = torch.randn(3, 4)
    state = {"a.weight": whole, "b.weight": torch.randn(4, 3)[:2], "b.bias": torch.randn(2, dtype=torch.float64)}
    assert adopt_parameters_(model, state, torch.device("cpu"), torch.float32) == 1
    assert model.a.weight.data_ptr() == whole.data_ptr()
    assert model.b.weight.data_ptr() != state["b.weight"].data_ptr()
    assert model.b.bias.dtype == torch.float32 and not any(p.is_meta for p in model.parameters())
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert torch.equal(model.b.weight, state["b.weight"]) and torch.equal(model.a.weight, whole)


def test_an_engine_given_tensors_its_caller_keeps_copies_them(monkeypatch) -> None:
    """A caller's LoadedModel (two engines built from one) is left alone: the model's parameters are its own, and
    never initialised in memory (nn.Linear's initialisation runs on meta tensors only)."""
    given = load_model("random:tiny-llama", seed=0)
    real_init = nn.init.kaiming_uniform_

    def meta_only(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert tensor.is_meta, "a parameter was initialised in memory, then overwritten by the load"
        return real_init(tensor, *args, **kwargs)

    monkeypatch.setattr(nn.init, "kaiming_uniform_", meta_only)
    engine = Engine(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=64), loaded=given)
    given_ptrs = {t.untyped_storage().data_ptr() for t in given.state_dict.values()}
    params = dict(engine.model.named_parameters())
    assert not any(p.untyped_storage().data_ptr() in given_ptrs for p in params.values())
    for name, param in params.items():
        assert torch.equal(param, given.state_dict[name])
