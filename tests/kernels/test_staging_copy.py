"""The kernel word copy, from device memory and (on a GPU) from pinned host memory."""
from __future__ import annotations

import torch

from services.gpu_worker.kernels.staging_copy import copy_words_
from tests.kernels.helpers import DEVICE, gpu_only


def test_copy_words_copies_every_word_of_a_partial_last_block():
    src = torch.arange(2500, dtype=torch.int32, device=DEVICE) - 7
    dst = torch.zeros_like(src)
    assert copy_words_(dst, src, block=1024) is dst
    assert torch.equal(dst, src)


@gpu_only
def test_copy_words_reads_pinned_host_memory_inside_a_cuda_graph():
    host = torch.zeros(3000, dtype=torch.int32).pin_memory()
    dst = torch.zeros(3000, dtype=torch.int32, device="cuda")
    copy_words_(dst, host)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_words_(dst, host)
    for step in range(3):  # the host rewrites the buffer; each replay reads what is there then
        host.copy_(torch.arange(3000, dtype=torch.int32) * (step + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), host)
