"""Programmatic dependent launch (PDL, Hopper and newer) for the decode path's Triton kernels.

A kernel launched with PDL may be scheduled onto the SMs while the kernel before it in the stream is still
draining: its launch and the dispatch of its programs overlap the previous kernel's tail instead of waiting for
its completion and memory flush. Each such kernel executes `griddepcontrol.wait` (gdc_wait) before it reads or
writes anything another kernel may produce or read, so results do not change; and it signals
`griddepcontrol.launch_dependents` at once, so a PDL launch after it (decode attention's reduce after its split
kernel, argmax's pick after its block max) can start as early. Captured into a CUDA graph, the launches become
programmatic edges. At batch 1 a decode step is ~290 small kernels with ~0.4 µs of idle between each pair.

The switch is process-wide (one engine per worker process): the engine sets it from EngineConfig.pdl before
it captures its graphs, and every launch in kernels/ asks `launch_options()`. Kernels take `USE_PDL` as a
constexpr, so with PDL off they compile without the instructions; the Triton interpreter (CPU tests) has no
grid dependency control, so there PDL is always off.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import hopper

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled (supported() is False)
    gdc_launch_dependents = gdc_wait = None

# 0: off; 1: PDL launches that wait before their first access; 2: and signal launch_dependents at their start
# (the next PDL kernel's programs then get dispatched while this one still runs). The H200 A/B is in
# docs/PERFORMANCE.md; set_enabled(True) takes ON_LEVEL.
ON_LEVEL = 2
_level = 0


def supported(device: torch.device | str) -> bool:
    """PDL can run on this device: CUDA compute capability ≥ 9.0, compiled kernels (not the interpreter)."""
    return gdc_wait is not None and hopper.is_hopper(device)


def resolve(mode: str, device: torch.device | str) -> bool:
    """EngineConfig.pdl → on/off: "auto" is on where supported; "on" where unsupported is an error."""
    return hopper.resolve(mode, "pdl", "programmatic dependent launch", mode != "off" and supported(device), device)


def set_enabled(on: bool, level: int | None = None) -> None:
    global _level
    if level is not None and level not in (0, 1, 2):
        raise ValueError(f"PDL level must be 0, 1 or 2, not {level!r}")
    _level = (ON_LEVEL if level is None else level) if on else 0


def is_enabled() -> bool:
    return _level > 0


def launch_options() -> dict:
    """Keyword arguments for a decode-path kernel launch: the USE_PDL constexpr and Triton's launch flag."""
    return {"USE_PDL": _level, "launch_pdl": True} if _level else {"USE_PDL": 0}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """(USE_PDL 2) let the next PDL kernel start launching; (≥ 1) wait until the previous kernel's writes are
    visible. Call before the first access to anything another kernel writes or reads."""
    if USE_PDL >= 2:
        gdc_launch_dependents()
    if USE_PDL >= 1:
        gdc_wait()
