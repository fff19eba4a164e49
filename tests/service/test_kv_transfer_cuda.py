"""CUDA IPC backend between two processes on one GPU: the child opens the parent's pool by handle and pulls
pages; the pages equal the parent's, bit for bit. Runs only where CUDA is available."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.kv_transfer.export import export_pool
from shared.messages import encode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys, torch
from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.kv_transfer.cuda_ipc import CudaIpcPuller
from shared.messages import KVSource, decode
source = decode(sys.stdin.buffer.read(), KVSource)
kv = KVCache(source.num_layers, 16, source.page_size, source.num_kv_heads, source.head_dim, torch.bfloat16, "cuda")
n = CudaIpcPuller().pull(source, "lease", [3, 7, 5], [1, 2, 3], kv)
print(n, float(kv.k[:, 1:4].double().sum()), float(kv.v[:, 1:4].double().sum()))
"""


def test_cuda_ipc_pull_copies_exactly_the_requested_pages() -> None:
    kv = KVCache(2, 32, 4, 2, 16, torch.bfloat16, "cuda")
    kv.k.normal_()
    kv.v.normal_()
    torch.cuda.synchronize()
    exported = export_pool(kv, "host", "unused", "")
    assert exported.source.cuda_k is not None and not exported.source.shm_name
    child = subprocess.run([sys.executable, "-c", CHILD], input=encode(exported.source), capture_output=True,
                           cwd=ROOT, timeout=300)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    num_bytes, k_sum, v_sum = child.stdout.decode().split()
    index = torch.tensor([3, 7, 5], device="cuda")
    assert int(num_bytes) == 2 * 2 * 3 * 4 * 2 * 16 * 2
    assert float(k_sum) == pytest.approx(float(kv.k.index_select(1, index).double().sum()), abs=1e-6)
    assert float(v_sum) == pytest.approx(float(kv.v.index_select(1, index).double().sum()), abs=1e-6)
