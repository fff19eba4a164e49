"""bench/model_speed.py's profile shares: each Triton kernel the engine runs is counted in its own family, the MoE
decode path's kernels included (before, they fell into "other"); and its A/B variants switch what they name."""
from __future__ import annotations

import pytest

from bench import model_speed
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


def test_the_w4a16_chunks_variant_switches_chunk_scales_and_restores_it():
    """`model_speed --presets P@awq:w4a16_chunks` builds its engine with kernels/w4a16.CHUNK_SCALES on, and leaves the
    default as it found it."""
    from services.gpu_worker.kernels import w4a16

    before = w4a16.CHUNK_SCALES
    with model_speed.variant("w4a16_chunks"):
        assert w4a16.CHUNK_SCALES is True
    assert w4a16.CHUNK_SCALES is before
