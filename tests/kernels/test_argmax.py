"""The two-launch row argmax vs torch.argmax: exact indices, first index on ties, NaN and -inf rows."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.argmax import argmax_rows, argmax_rows_ref
from tests.kernels.helpers import DEVICE, gpu_only


def test_argmax_matches_torch_across_blocks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((5, 1000), generator=gen).to(DEVICE)
    assert torch.equal(argmax_rows(x, block=64), argmax_rows_ref(x))


def test_argmax_ties_take_the_first_index_even_across_blocks():
    x = torch.zeros((4, 300))
    x[0, [7, 200]] = 5.0  # in different blocks: the first block wins
    x[1, [70, 71]] = 5.0  # in one block
    x[2, 299] = 1.0  # the last element, in the partial last block
    x[3] = float("-inf")  # all -inf: index 0, like torch
    x = x.to(DEVICE)
    got = argmax_rows(x, block=64)
    assert got.tolist() == [7, 70, 299, 0] == argmax_rows_ref(x).tolist()


def test_argmax_nan_ranks_first_like_torch():
    x = torch.randn((2, 200))
    x[0, 150] = float("nan")
    x[1, 10] = float("inf")
    x = x.to(DEVICE)
    assert argmax_rows(x, block=64).tolist() == [150, 10] == argmax_rows_ref(x).tolist()


def test_argmax_writes_into_out_and_handles_bf16_strided_rows():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn((3, 130), generator=gen).to(torch.bfloat16).to(DEVICE)
    x = base[:, :129]  # row stride 130, unit column stride
    out = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(x, out=out, block=32) is out
    assert torch.equal(out, argmax_rows_ref(x))


def test_argmax_of_no_rows():
    assert argmax_rows(torch.empty((0, 10), device=DEVICE)).shape == (0,)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("batch", [1, 7, 384])
def test_argmax_llama3_vocab(batch):
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn((batch, 128256), generator=gen).to(DEVICE)
    x[:, 1000] = x.max(dim=-1).values  # ties with the true max somewhere later or earlier
    assert torch.equal(argmax_rows(x), argmax_rows_ref(x))
