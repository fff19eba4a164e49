"""Engine tests run in both step modes: serial, and overlap (step N+1 queued before step N's tokens are read;
the CUDA default). On the CPU the overlap path runs the same bookkeeping, only without the speed-up.

A test module imports `step_mode` (an autouse fixture, parametrised) and reads MODE["overlap"] where it
builds its engines.
"""
from __future__ import annotations

import pytest

MODE = {"overlap": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def step_mode(request: pytest.FixtureRequest):
    MODE["overlap"] = request.param
    yield
    MODE["overlap"] = False
