"""staging.to_device: the numpy path gives exactly the tensor torch.tensor(values) gives, for every shape and dtype
the engine hands it; bench.host_inputs builds an eager step's inputs both ways and checks they agree."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import host_inputs
from services.gpu_worker.staging import to_device


@pytest.mark.parametrize(("values", "dtype"), [
    ([3, 1, 4, 1, 5], torch.long),
    ([2 ** 31 - 1, 0, 7], torch.int32),
    ([0.1, 2.5, -3.75], torch.float32),
    ([[1, 2], [3, 4], [5, 6]], torch.long),  # a [P, 2] index
    ([], torch.long),
    ([True, False], torch.bool),
    ((9, 8, 7), torch.int32),
    ([0.5, 1.0], torch.bfloat16),  # no numpy dtype: torch converts
])
def test_to_device_equals_torch_tensor(values, dtype) -> None:
    got, want = to_device(values, dtype, "cpu"), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_to_device_takes_an_array_as_it_is() -> None:
    table = np.arange(12, dtype=np.int32).reshape(3, 4)
    got = to_device(table, torch.int32, "cpu")
    assert torch.equal(got, torch.tensor(table.tolist(), dtype=torch.int32))


def test_the_host_inputs_bench_builds_the_same_tensors_both_ways(tmp_path) -> None:
    result = host_inputs.main(["--num-decodes", "5", "--context", "40", "--chunk", "70", "--repeats", "2",
                               "--out", str(tmp_path / "h.json")])
    assert set(result["median_ms"]) == {"torch_tensor_of_lists", "numpy"}
    items = host_inputs.mixed_step(3, 33, 50)
    assert [t.shape[0] for t in host_inputs.numpy_way(items)] == [53, 53, 53, 5, 4, 4]
