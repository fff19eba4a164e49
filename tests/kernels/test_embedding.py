"""The embedding that takes some input tokens from the previous step's device tokens, vs its torch form."""
from __future__ import annotations

import torch

from services.gpu_worker.kernels.embedding import embedding_fed, embedding_fed_ref
from tests.kernels.helpers import DEVICE, randn


def test_embedding_fed_mixes_host_and_device_tokens():
    gen = torch.Generator().manual_seed(0)
    weight = randn((50, 40), gen, torch.float32, DEVICE)
    ids = torch.tensor([3, -1, 7, -1, 0], dtype=torch.int32, device=DEVICE)  # -1: a placeholder
    src = torch.tensor([-1, 2, -1, 0, -1], dtype=torch.int32, device=DEVICE)
    prev = torch.tensor([11, 12, 49], dtype=torch.int64, device=DEVICE)
    out = embedding_fed(weight, ids, src, prev, block=16)  # 40 columns: three blocks, the last partial
    ref = embedding_fed_ref(weight, ids, src, prev)
    assert torch.equal(out, ref)
    assert torch.equal(out[1], weight[49]) and torch.equal(out[3], weight[11]) and torch.equal(out[0], weight[3])


def test_embedding_fed_without_placeholders_is_a_plain_lookup():
    gen = torch.Generator().manual_seed(1)
    weight = randn((30, 8), gen, torch.bfloat16, DEVICE)
    ids = torch.tensor([29, 0, 5], dtype=torch.int64, device=DEVICE)
    src = torch.full((3,), -1, dtype=torch.int32, device=DEVICE)
    out = embedding_fed(weight, ids, src, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight))
