"""bench/model_speed.py's profile shares: each Triton kernel the engine runs is counted in its own family, the MoE
decode path's kernels included (before, they fell into "other")."""
from __future__ import annotations

import pytest

from bench.model_speed import family


@pytest.mark.parametrize("kernel,want", [
    ("_moe_gemm_kernel", "moe grouped GEMM"), ("_gate_up_kernel", "moe GEMV"), ("_down_kernel", "moe GEMV"),
    ("_route_topk_kernel", "moe routing"), ("_align_small_kernel", "moe routing"),
    ("_chunk_place_kernel", "moe routing"), ("_norm_router_kernel", "RMSNorm + router"), ("_gemv_kernel", "GEMV"),
    ("_decode_split_kernel", "attention"), ("_decode_reduce_kernel", "attention"), ("_rms_norm_kernel", "RMSNorm"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "cuBLAS GEMM"),
    ("void at::native::reduce_kernel<128, 4>", "other (torch elementwise, sort, softmax, top-k)")])
def test_each_kernel_in_its_family(kernel, want):
    assert family(kernel) == want
