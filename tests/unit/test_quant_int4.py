"""INT4 W4A16 (services/gpu_worker/quant/int4.py): RTN within scale/2, the AWQ and GPTQ v1 layouts written and read
back exactly, hand-packed words of known integers (a wrong nibble order or a lost off-by-one fails them), GPTQ
act-order honoured by reordering, and CUDA inputs on the Triton kernel."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.quant.int4 import (Int4Weight, dequantize_int4, from_awq, from_gptq, int4_linear,
                                            int4_matmul, pack_int4, quantize_int4, to_awq, to_gptq,
                                            unpack_int4)


def _word(nibbles: list[int]) -> int:
    """Eight nibbles (nibble 0 first) → the int32 value of their word."""
    value = sum(v << (4 * i) for i, v in enumerate(nibbles))
    return value - 2 ** 32 if value >= 2 ** 31 else value


def _weights(n: int = 16, k: int = 256, dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]  # [N, K]
    w[0, :32] = 0.0  # an all-zero group
    w[1, :32] = w[1, :32].abs() + 0.5  # an all-positive group (zero point 0)
    return w.to(dtype)


def _assert_same(a: Int4Weight, b: Int4Weight) -> None:
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)
    assert a.group_size == b.group_size
    assert (a.perm is None) == (b.perm is None) and (a.perm is None or torch.equal(a.perm, b.perm))


def test_pack_and_unpack_are_inverse_with_nibble_i_holding_column_8j_plus_i() -> None:
    values = torch.arange(16, dtype=torch.int32).repeat(2, 2)  # [2, 32]
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (2, 4)
    assert packed[0, 0].item() == _word(list(range(8))) and packed[0, 1].item() == _word(list(range(8, 16)))
    assert torch.equal(unpack_int4(packed), values)


@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_dequantizes_within_half_a_scale(symmetric: bool) -> None:
    w = _weights(dtype=torch.float32)
    q = quantize_int4(w, group_size=32, symmetric=symmetric)
    assert q.qweight.shape == (16, 32) and q.scales.shape == (16, 8) and q.zeros.shape == (16, 8)
    assert q.scales.dtype == q.zeros.dtype == torch.float32
    values = unpack_int4(q.qweight)
    assert values.min() >= 0 and values.max() <= 15
    assert torch.equal(q.zeros, q.zeros.round()) and q.zeros.min() >= 0 and q.zeros.max() <= 15
    if symmetric:
        assert (q.zeros == 8).all()
    else:
        assert q.zeros[1, 0] == 0  # the all-positive group
    err = (dequantize_int4(q) - w).abs().reshape(16, 8, 32)
    assert (err <= q.scales[..., None] * 0.5 * (1 + 1e-5) + 1e-7).all()
    assert (dequantize_int4(q)[0, :32] == 0).all()


def test_quantization_refuses_a_group_size_that_does_not_fit() -> None:
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(8, 96), group_size=64)
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(8, 96), group_size=12)


@pytest.mark.parametrize("symmetric", [False, True])
def test_awq_round_trip_is_exact(symmetric: bool) -> None:
    q = quantize_int4(_weights(), group_size=32, symmetric=symmetric)
    tensors = to_awq(q)
    assert tensors["qweight"].shape == (256, 2) and tensors["qweight"].dtype == torch.int32
    assert tensors["qzeros"].shape == (8, 2) and tensors["scales"].shape == (8, 16)
    assert tensors["scales"].dtype == torch.float16
    _assert_same(from_awq(**tensors, group_size=32), q)


def test_a_hand_packed_awq_word_unpacks_in_awqs_interleaved_order() -> None:
    """Columns 0..7 of input row k hold 1..8 (plus k); AWQ stores them in nibbles 0..7 as columns 0,2,4,6,1,3,5,7."""
    k = 8
    words = [_word([c + 1 + row for c in (0, 2, 4, 6, 1, 3, 5, 7)]) for row in range(k)]
    qweight = torch.tensor(words, dtype=torch.int32)[:, None]  # [K=8, N/8=1]
    qzeros = torch.tensor([[_word([2, 2, 2, 2, 3, 3, 3, 3])]], dtype=torch.int32)  # columns 0,2,4,6: 2; 1,3,5,7: 3
    scales = torch.ones(1, 8, dtype=torch.float16)
    w = from_awq(qweight, qzeros, scales, group_size=8)
    expected_q = torch.tensor([[c + 1 + row for row in range(k)] for c in range(8)])  # [N, K]
    assert torch.equal(unpack_int4(w.qweight), expected_q.to(torch.int32))
    assert w.zeros[:, 0].tolist() == [2, 3, 2, 3, 2, 3, 2, 3]
    assert torch.equal(dequantize_int4(w), (expected_q - torch.tensor([2, 3] * 4)[:, None]).half())
    assert torch.equal(to_awq(w)["qweight"], qweight)


@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_round_trip_is_exact(symmetric: bool) -> None:
    q = quantize_int4(_weights(), group_size=32, symmetric=symmetric)
    tensors = to_gptq(q)
    assert tensors["qweight"].shape == (32, 16) and tensors["qzeros"].shape == (8, 2)
    assert tensors["scales"].shape == (8, 16) and tensors["g_idx"].tolist() == [k // 32 for k in range(256)]
    assert tensors["g_idx"].dtype == torch.int32
    _assert_same(from_gptq(**tensors, group_size=32), q)


def test_a_hand_packed_gptq_checkpoint_reads_with_the_zero_off_by_one() -> None:
    """qweight nibble i of row j is input feature 8j + i; a symmetric v1 checkpoint stores its zero 8 as 7, and an
    asymmetric zero point 0 as 15 (0 - 1 in four bits)."""
    k, n = 16, 8
    q = torch.tensor([[(row * 3 + col) % 16 for col in range(n)] for row in range(k)])  # [K, N]
    qweight = torch.tensor([[_word(q[8 * j: 8 * j + 8, col].tolist()) for col in range(n)] for j in range(2)],
                           dtype=torch.int32)  # [K/8, N]
    stored = [7, 7, 7, 7, 15, 0, 4, 7]  # zero - 1 per column
    qzeros = torch.tensor([[_word(stored)]], dtype=torch.int32)  # [1 group, N/8]
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    w = from_gptq(qweight, qzeros, scales, torch.zeros(k, dtype=torch.int32), group_size=16)
    assert w.perm is None
    assert w.zeros[:, 0].tolist() == [8, 8, 8, 8, 0, 1, 5, 8]
    assert torch.equal(unpack_int4(w.qweight), q.t().to(torch.int32))
    expected = (q.t() - torch.tensor([8, 8, 8, 8, 0, 1, 5, 8])[:, None]) * 0.5
    assert torch.equal(dequantize_int4(w), expected.half())
    assert torch.equal(to_gptq(w)["qzeros"], qzeros)


def _act_order_checkpoint() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A GPTQ v1 checkpoint of K = 64, G = 16 whose g_idx is a shuffled act-order one, and its dense weight
    dequantized straight from the GPTQ formula w[k, n] = (q[k, n] - (stored_zero + 1)) * scale[g_idx[k], n]."""
    gen = torch.Generator().manual_seed(3)
    k, n, g = 64, 16, 16
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)].to(torch.int32)  # [K]
    q = torch.randint(0, 16, (k, n), generator=gen)  # [K, N]
    stored = torch.randint(0, 15, (k // g, n), generator=gen)  # [K/G, N] zero - 1
    scales = (torch.rand(k // g, n, generator=gen) + 0.1).half()  # [K/G, N]
    tensors = {"qweight": pack_int4(q.t()).t().contiguous(), "qzeros": pack_int4(stored), "scales": scales,
               "g_idx": g_idx}
    gi = g_idx.long()
    dense = ((q - (stored[gi] + 1)) * scales[gi].float()).t()  # [N, K]
    return tensors, dense.half()


def test_gptq_act_order_is_honoured_by_reordering_not_requantizing() -> None:
    tensors, dense = _act_order_checkpoint()
    w = from_gptq(**tensors, group_size=16)
    assert w.perm is not None and torch.equal(w.perm, torch.argsort(tensors["g_idx"].long(), stable=True))
    assert torch.equal(dequantize_int4(w), dense)  # the checkpoint's integers and scales, exactly
    x = torch.randn(3, 64).half()
    assert torch.allclose(int4_linear(x.float(), w), x.float() @ dense.float().t(), atol=1e-3)
    again = to_gptq(w)
    assert torch.equal(again["g_idx"], tensors["g_idx"]) and torch.equal(again["qweight"], tensors["qweight"])
    _assert_same(from_gptq(**again, group_size=16), w)
    with pytest.raises(ValueError):
        to_awq(w)


def test_a_g_idx_with_uneven_groups_is_refused() -> None:
    tensors, _ = _act_order_checkpoint()
    tensors["g_idx"] = torch.tensor([0] * 17 + [1] * 15 + [2] * 16 + [3] * 16, dtype=torch.int32)
    with pytest.raises(ValueError):
        from_gptq(**tensors, group_size=16)


def test_int4_linear_is_the_dequantized_matmul_and_close_to_the_float_one() -> None:
    gen = torch.Generator().manual_seed(4)
    w, x, bias = torch.randn(24, 128, generator=gen), torch.randn(5, 128, generator=gen), torch.randn(24, generator=gen)
    q = quantize_int4(w, group_size=64)
    out = int4_linear(x, q, bias)
    assert out.shape == (5, 24) and out.dtype == torch.float32
    assert torch.allclose(out, x @ dequantize_int4(q).t() + bias, atol=1e-5)
    ref = x @ w.t() + bias
    assert (out - ref).norm() / ref.norm() < 0.15  # 4 bits: ~0.1 relative error per weight, averaged over K
    assert int4_linear(x.bfloat16(), q).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inputs_take_the_triton_kernel_and_match_the_reference() -> None:
    q = quantize_int4(torch.randn(256, 512), group_size=128)
    q = Int4Weight(q.qweight.cuda(), q.scales.cuda().bfloat16(), q.zeros.cuda().bfloat16(), q.group_size)
    for m in (1, 40):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ dequantize_int4(q).float().t()
        got = int4_matmul(x, q)
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2)
