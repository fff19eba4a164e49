"""What the Hopper-only switches of the decode path share (pdl.py, l2_prefetch.py): whether a device can run them,
and how an EngineConfig value of "auto", "on" or "off" resolves."""
from __future__ import annotations

import os

import torch

MODES = ("auto", "on", "off")


def is_hopper(device: torch.device | str) -> bool:
    """A CUDA device of compute capability >= 9.0, and compiled kernels (Triton's interpreter runs no PTX)."""
    device = torch.device(device)
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def resolve(mode: str, option: str, feature: str, supported: bool, device: torch.device | str) -> bool:
    """EngineConfig.<option> → on/off: "auto" is on where `supported`; "on" where not is an error naming `feature`."""
    if mode not in MODES:
        raise ValueError(f"{option} must be 'auto', 'on' or 'off', not {mode!r}")
    if mode == "on" and not supported:
        raise ValueError(f"{feature} needs a CUDA device of compute capability >= 9.0 and compiled Triton kernels; "
                         f"{torch.device(device)} has not")
    return mode == "on" or (mode == "auto" and supported)
