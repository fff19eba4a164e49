"""kernels/pdl.py's switch: which launches get programmatic dependent launch. Its effect on the kernels' results is
tested on the GPU (test_triton_engine.py: test_programmatic_dependent_launch_changes_no_bit)."""
import pytest
import torch

from services.gpu_worker.kernels import pdl


@pytest.fixture
def hopper(monkeypatch):
    """A compiled (not interpreted) Triton and a CUDA device 0 of compute capability 9.0."""
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(pdl, "_capable", {0: True})
    monkeypatch.setattr(pdl, "_SWITCHED_OFF", False)


def test_on_for_hopper_inside_a_step_of_our_kernels_only(hopper):
    device = torch.device("cuda", 0)
    assert pdl.args(device) == {"PDL": 0}  # outside any scope: a cuBLAS GEMM may be next to the kernel
    with pdl.scope(True):
        assert pdl.args(device) == {"PDL": 2, "launch_pdl": True}
        with pdl.wait_only():
            assert pdl.args(device) == {"PDL": 1, "launch_pdl": True}
        with pdl.scope(False):
            assert pdl.args(device) == {"PDL": 0}
        assert pdl.enabled(device)
    assert not pdl.enabled(device)


def test_off_by_environment_in_the_ab_context_and_on_older_gpus(hopper, monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setitem(pdl._state, "in_scope", True)
    with pdl.disabled():
        assert pdl.args(device) == {"PDL": 0}
    assert pdl.enabled(device)  # restored
    monkeypatch.setattr(pdl, "_SWITCHED_OFF", True)  # RADIXSERVE_PDL=0 at import
    assert pdl.args(device) == {"PDL": 0}
    monkeypatch.setattr(pdl, "_SWITCHED_OFF", False)
    monkeypatch.setattr(pdl, "_capable", {0: False})  # an A100: griddepcontrol is sm_90+
    assert pdl.args(device) == {"PDL": 0}


def test_off_on_the_cpu_and_under_the_interpreter(hopper, monkeypatch):
    monkeypatch.setitem(pdl._state, "in_scope", True)
    assert pdl.args(torch.device("cpu")) == {"PDL": 0}
    monkeypatch.setattr(pdl, "_INTERPRET", True)
    assert pdl.args(torch.device("cuda", 0)) == {"PDL": 0}
