"""Host lists to device tensors without waiting for the device, and without torch's per-element list conversion.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the stream, so on the
engine's hot path every such call would wait for the step still running on the GPU (the overlap mode's whole
point). Here the values go through pinned memory with a non-blocking copy instead; PyTorch's pinned-memory
cache keeps the staging block alive until the copy has run.

The list becomes an array through numpy, not `torch.tensor(list)`, which converts element by element: a W1-sized
mixed step's inputs (~8.6k input ids, positions and slots, and a page table of 369 rows by 514 pages, built as an
array by model_runner) took 14.1 ms of host time that way and 3.7 ms this way, list building included (`python -m
bench.host_inputs`, this 2-core CPU, 2026-12-06). Every eager step pays it on the host, in front of the GPU.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def to_device(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values (a flat or rectangular nested sequence, or an array) as a `dtype` tensor on `device`."""
    device = torch.device(device)
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is None:  # a dtype numpy lacks (bf16, fp8): torch converts it
        host = torch.tensor(values, dtype=dtype)
    else:
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np_dtype))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
