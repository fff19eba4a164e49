"""Programmatic dependent launch (PDL) for the kernels of a decode step, on Hopper and later GPUs.

A decode step of one token is hundreds of launches of a few µs each (Llama-3.1-8B: 9 a layer, Qwen3-30B-A3B: 10),
and between two kernels of a CUDA graph the GPU idles while the first one drains and the next one's programs are
placed. Launched with PDL, a kernel starts while the kernel before it still runs: its programs become resident, may
read what no kernel of the step writes (a layer's weights), and then block in `griddepcontrol.wait` until the kernel
before has finished and its writes are visible. Each kernel lets the next one start as soon as its own programs have
passed that wait (`gdc_launch_dependents`; without it the next one starts when this one ends, the `wait_only` A/B).

Only where every kernel of the step is ours: a step of one token with the projections on kernels/gemv.py (one GPU,
the default), which the model marks with `scope(True)` (LlamaForCausalLM.runs_only_our_kernels). Elsewhere a cuBLAS
GEMM sits between our kernels, and a Triton kernel it releases early holds SM resources the GEMM's later programs
need: that made PDL slower when a batch-1 step's projections still ran on cuBLAS (docs/perf-log/2026-12-03.md). On
an H100 it took Qwen3-30B-A3B's batch-1 step from 3.259 to 2.954 ms, Llama-3.1-8B's from 5.463 to 5.362 (wait only:
3.054, 5.388; bench/results/h100_20261207_s24/model_speed_pdl_ab.json).

The contract, for every kernel launched with `launch_pdl`: call `wait(PDL)` before the first load of anything a
kernel of the step writes, and before the first store. Reads of weights may come first. `args(device)` pairs the
kernel's PDL constexpr with the launch attribute, so the two cannot disagree; a kernel launched without the attribute
(any cuBLAS or torch kernel between two of ours) waits for the one before it as usual, which keeps the chain safe.

On by default on CUDA devices of compute capability 9.0 and later; RADIXSERVE_PDL=0 at start-up turns it off (an
A/B, or a driver that mishandles it). Off under TRITON_INTERPRET=1 and on older GPUs, where the kernels compile
without it.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as triton.jit does
_SWITCHED_OFF = os.environ.get("RADIXSERVE_PDL", "1") == "0"
_capable: dict[int, bool] = {}
# what the context managers below set: whether the step runs only our kernels, the A/B's forced off and wait-only
_state = {"in_scope": False, "forced_off": False, "wait_only": False}


def enabled(device: torch.device) -> bool:
    """Whether kernels launched for `device` now use PDL: inside scope(True), on a capable GPU, not switched off."""
    if not _state["in_scope"] or _state["forced_off"] or _SWITCHED_OFF or _INTERPRET or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def args(device: torch.device) -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr, and the launch attribute when on."""
    if not enabled(device):
        return {"PDL": 0}
    return {"PDL": 1 if _state["wait_only"] else 2, "launch_pdl": True}


@contextlib.contextmanager
def _setting(key: str, value: bool):
    saved, _state[key] = _state[key], value
    try:
        yield
    finally:
        _state[key] = saved


def scope(on: bool):
    """Launches inside use PDL if `on` (the caller's step runs only our kernels) and the device can."""
    return _setting("in_scope", on)


def in_scope() -> bool:
    return _state["in_scope"]


def disabled():
    """PDL off for the launches inside (and the CUDA graphs captured inside): the A/B of bench/model_speed.py."""
    return _setting("forced_off", True)


def wait_only():
    """Kernels inside wait for the one before but do not release the next early (it starts when they end)."""
    return _setting("wait_only", True)


@triton.jit
def wait(PDL: tl.constexpr):
    """PDL 0: nothing. 1: block until the kernel before has finished and its writes are visible. 2: then also let
    the next kernel start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
