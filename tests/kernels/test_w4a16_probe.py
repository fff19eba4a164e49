"""bench/w4a16_probe.py's kernel: its full variant is the INT4 one-token kernel's arithmetic (checked against the
dequantized matmul), and each ablation takes out the part it names, so its result differs."""
from __future__ import annotations

import torch

from bench import w4a16_probe as probe
from services.gpu_worker.kernels import w4a16 as w4
from tests.kernels.helpers import DEVICE, rel_err


def test_the_full_probe_is_the_kernel_and_each_ablation_changes_the_result():
    gen = torch.Generator().manual_seed(0)
    n, k = 16, 512
    x = torch.randn((1, k), generator=gen).to(DEVICE)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, generator=gen).to(DEVICE)
    scales = (torch.rand((n, k // probe.GROUP), generator=gen) * 0.02).to(DEVICE)
    zeros = torch.randint(0, 16, (n, k // probe.GROUP), generator=gen).float().to(DEVICE)
    ref = x @ w4.dequantize_reference(qweight, scales, zeros, probe.GROUP).t()
    out = torch.empty((1, n), device=DEVICE)
    results = {v: probe.probe(x, qweight, scales, zeros, out, 8, 256, flags).clone()
               for v, flags in probe.VARIANTS.items()}
    assert rel_err(results["full"], ref) < 1e-5
    assert all(rel_err(results[v], ref) > 0.5 for v in probe.VARIANTS if v != "full")
