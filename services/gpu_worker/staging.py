"""Host lists to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the stream, so on the
engine's hot path every such call would wait for the step still running on the GPU (the overlap mode's whole
point). Here the values go through pinned memory with a non-blocking copy instead; PyTorch's pinned-memory
cache keeps the staging block alive until the copy has run.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
