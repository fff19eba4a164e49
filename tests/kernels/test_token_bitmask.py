"""apply_token_bitmask_ vs StructuredOutput.apply's torch ops on the CPU: the same -inf positions and every other
value untouched (unconstrained rows, ids past V in the last word, the columns of a wider row stride)."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels.token_bitmask import apply_token_bitmask_
from services.gpu_worker.structured_output import StructuredOutput
from tests.kernels.helpers import DEVICE, gpu_only


def _random_bitmask(num_rows: int, num_words: int, gen: torch.Generator) -> torch.Tensor:
    """[R, W] int32 of random words, with an all-clear word, an all-set word and the sign bit alone among them."""
    bitmask = torch.randint(-(1 << 31), 1 << 31, (num_rows, num_words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = 0
    bitmask[-1, -1] = -1  # ids past V in the last word allowed: nothing to do there
    bitmask[0, -1] = -(1 << 31)  # only bit 31
    return bitmask


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """StructuredOutput.apply's torch path on a CPU copy (logits may be a view: its base is masked and returned)."""
    base = (logits if logits._base is None else logits._base).cpu().clone()
    view = base.as_strided(logits.shape, logits.stride(), logits.storage_offset())
    StructuredOutput(None, vocab_size=logits.shape[1], eos_token_ids=[0],
                     device=torch.device("cpu")).apply(view, bitmask.cpu(), rows)
    return base


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], rows_dtype: torch.dtype,
           block: int) -> None:
    want = _reference(logits, bitmask, rows)
    got = apply_token_bitmask_(logits, bitmask.to(DEVICE), torch.tensor(rows, dtype=rows_dtype, device=DEVICE),
                               block=block)
    assert got is logits
    got = (logits if logits._base is None else logits._base).cpu()
    assert torch.equal(got.isneginf(), want.isneginf())
    assert torch.equal(got, want)


@pytest.mark.parametrize("vocab", [100, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block", [32, 64, 4096])
def test_matches_the_torch_mask_on_unsorted_rows(vocab, dtype, rows_dtype, block):
    gen = torch.Generator().manual_seed(vocab + block)
    logits = torch.randn((6, vocab), generator=gen).to(dtype)
    logits[1, 3] = float("-inf")  # already -inf stays so, allowed or not
    logits[4, 5] = float("-inf")
    logits = logits.to(DEVICE)
    rows = [4, 0, 2, 5]  # not sorted, not contiguous; rows 1 and 3 unconstrained
    bitmask = _random_bitmask(len(rows), -(-vocab // 32), gen)

    _check(logits, bitmask, rows, rows_dtype, block)

    assert logits[[1, 3]].isfinite().sum().item() == 2 * vocab - 1  # only the -inf put there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wider_row_stride_and_a_wider_bitmask(dtype):
    """Logits a view of wider rows (the columns past V must stay), the bitmask one word wider than V needs."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn((5, 128), generator=gen).to(dtype).to(DEVICE)
    logits = base[:, :70]  # row stride 128: ids 70..127 sit in memory right after each row
    rows = [3, 1]
    bitmask = torch.zeros((2, 4), dtype=torch.int32)  # 128 bits for 70 tokens
    bitmask[0, 0] = 1 - (1 << 31)  # tokens 0 and 31
    bitmask[1, 2] = 1 << 5  # token 69
    before = base.clone()

    _check(logits, bitmask, rows, torch.int64, block=32)

    assert logits[3].isfinite().nonzero().flatten().tolist() == [0, 31]
    assert logits[1].isfinite().nonzero().flatten().tolist() == [69]
    assert torch.equal(base[:, 70:], before[:, 70:])
    assert torch.equal(base[[0, 2, 4]], before[[0, 2, 4]])


def test_every_row_constrained_and_none():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((3, 100), generator=gen).to(DEVICE)
    _check(logits, _random_bitmask(3, 4, gen), [2, 1, 0], torch.int32, block=64)

    before = logits.clone()
    apply_token_bitmask_(logits, torch.empty((0, 4), dtype=torch.int32, device=DEVICE),
                         torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama3_vocab_at_batch_64_through_structured_output(dtype):
    """StructuredOutput.apply on CUDA (pinned bitmask, non-blocking copies, the kernel) vs its torch path."""
    vocab, batch = 128256, 64
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn((batch, vocab), generator=gen).to(dtype)
    rows = torch.randperm(batch, generator=gen)[:48].tolist()
    structured = StructuredOutput(None, vocab_size=vocab, eos_token_ids=[0], device=torch.device("cuda"))
    bitmask = _random_bitmask(len(rows), structured.num_words, gen).pin_memory()
    want = _reference(logits, bitmask, rows)

    got = structured.apply(logits.to("cuda"), bitmask, rows)

    assert torch.equal(got.cpu().isneginf(), want.isneginf())
    assert torch.equal(got.cpu(), want)
