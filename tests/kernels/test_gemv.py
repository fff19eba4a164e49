"""The Triton GEMV (kernels/gemv.py) against its fp32 reference: one token and several, whole rows and split-K
partials, a bias, shapes whose N and K do not fill the tile."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.kernels import gemv as g
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _check(num_tokens, n, k, parts, dtype, tol, bias=False, config=None):
    gen = torch.Generator().manual_seed(num_tokens * 7 + n + k + parts)
    x = randn((num_tokens, k), gen, dtype, DEVICE)
    w = randn((n, k), gen, dtype, DEVICE, scale=k ** -0.5)
    b = randn((n,), gen, dtype, DEVICE) if bias else None
    out, ref = g.gemv(x, w, b, parts, config), g.gemv_ref(x, w, b, parts)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("parts", [1, 4])
def test_gemv_small(num_tokens, parts):
    # N = 40 fills 2.5 tiles of 16 rows; K = 96 over 4 parts is 24 columns a part, not a multiple of BLOCK_K
    _check(num_tokens, 40, 96, parts, torch.float32, 1e-5, config=g.GemvConfig(16, 16, 4))


def test_gemv_even_k_and_bias():
    _check(1, 24, 128, 1, torch.float32, 1e-5, bias=True, config=g.GemvConfig(8, 32, 2))
    _check(5, 24, 128, 1, torch.float32, 1e-5, bias=True, config=g.GemvConfig(16, 32, 4))


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_gemv_of_fp8_weights_applies_each_rows_scale(num_tokens):
    """e4m3 weights with a float32 scale per row (quant/fp8.py's layout): x @ (weight · scale)ᵀ, x in its own dtype,
    with a bias; a missing scale would be off by the scales' spread (0.5 to 2 here)."""
    from services.gpu_worker.quant.fp8 import quantize_weight_fp8

    gen = torch.Generator().manual_seed(11)
    x = torch.randn((num_tokens, 96), generator=gen).to(DEVICE)
    dense = torch.randn((40, 96), generator=gen) * torch.linspace(0.5, 2.0, 40)[:, None] * 96 ** -0.5
    qweight, scale = (t.to(DEVICE) for t in quantize_weight_fp8(dense))
    bias = torch.randn((40,), generator=gen).to(DEVICE)
    out = g.gemv(x, qweight, bias, config=g.GemvConfig(16, 32, 4), scale=scale)
    ref = g.gemv_ref(x, qweight, bias, scale=scale)
    assert out.dtype == x.dtype and rel_err(out, ref) < 1e-5
    assert rel_err(g.gemv(x, qweight, bias, config=g.GemvConfig(16, 32, 4)), ref) > 0.1


def test_gemv_configs_fit_the_shapes_they_serve():
    """Llama-3.1-8B's projections at one token take the H200's measured tiles, and Qwen3-30B-A3B's q/k/v and LM head
    the H100's; every shape's tile is no wider than a part of K, and the dot path's has the 16 columns tl.dot
    needs."""
    llama8b = ((6144, 4096, 1), (4096, 4096, 1), (28672, 4096, 1), (4096, 14336, 1), (128256, 4096, 1),
               (5120, 2048, 1), (151936, 2048, 1))
    others = ((4096, 4096, 2), (4096, 14336, 2), (576, 576, 1), (1536, 576, 2), (49152, 576, 1), (2048, 4096, 1))
    for n, k, parts in llama8b + others:
        for m in (1, 2, 8, 16):
            cfg = g.config_for(n, k, parts, m)
            assert cfg.block_k <= triton_next_pow2(k // parts) and cfg.block_n >= (16 if m > 1 else 1)
            assert cfg == (g.TUNED[(n, k, parts, 1)] if m == 1 and (n, k, parts) in llama8b
                           else g.heuristic_config(n, k, parts, m))


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def test_gemv_rejects_what_it_cannot_compute():
    x, w = torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError):
        g.gemv(torch.zeros(17, 8, device=DEVICE), w)
    with pytest.raises(ValueError):
        g.gemv(x, w, parts=3)
    with pytest.raises(ValueError):
        g.gemv(x, w, torch.zeros(4, device=DEVICE), parts=2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 8])
@pytest.mark.parametrize("n,k,parts", [(6144, 4096, 1), (4096, 4096, 4), (28672, 4096, 1), (4096, 14336, 4)])
def test_gemv_llama8b_shapes(num_tokens, n, k, parts):
    _check(num_tokens, n, k, parts, torch.bfloat16, 1e-2)


def test_the_flag_reaches_the_engine_from_serve_and_the_worker(tmp_path, capsys):
    """`radixserve serve --gemv-max-tokens N|auto` passes its value to each gpu_worker, whose config passes it to the
    engine (auto, the default, as None: EngineConfig resolves it); a value past the kernel's MAX_TOKENS, or not a
    number, is refused with the flag's name, by serve before it starts anything and by the worker's config."""
    import argparse

    from radixserve import serve
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.gemv_option import GEMV_MAX_TOKENS_LIMIT
    from shared.config import load_config

    assert GEMV_MAX_TOKENS_LIMIT == g.MAX_TOKENS
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    for flag, passed in ([], "auto"), (["--gemv-max-tokens", "1"], "1"), (["--gemv-max-tokens", "0"], "0"):
        args = parser.parse_args([*flag, "--workers", "2", "--redis-url", "redis://127.0.0.1:1"])
        workers = [c for c in serve.build_suite(args, tmp_path).children if c.argv[0] == "services.gpu_worker"]
        assert len(workers) == 2
        for child in workers:
            assert child.argv[child.argv.index("--gemv-max-tokens") + 1] == passed
    for bad in ("17", "-1", "one"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--gemv-max-tokens", bad])
        assert f"--gemv-max-tokens: gemv_max_tokens must be auto or 0 to 16, not '{bad}'" in capsys.readouterr().err
    assert load_config(WorkerConfig, ["--gemv-max-tokens", "1"]).engine_config().gemv_max_tokens == 1
    assert load_config(WorkerConfig, ["--gemv-max-tokens", "0"]).engine_config().gemv_max_tokens == 0
    assert WorkerConfig().engine_config().gemv_max_tokens is None  # auto: 1 on a single CUDA GPU, else cuBLAS
    for bad in ("17", "one"):
        with pytest.raises(ValueError, match="gemv_max_tokens must be"):
            WorkerConfig(gemv_max_tokens=bad)


def test_fp8_weights_take_their_own_tuned_tile(monkeypatch):
    """TUNED_FP8 (e4m3 weights, kernel_table --fp8-gemv-sweep) comes first for an e4m3 weight; a bf16 weight, and a
    shape TUNED_FP8 lacks, keep TUNED's tile."""
    key = (6144, 4096, 1, 1)
    monkeypatch.setitem(g.TUNED_FP8, key, g.GemvConfig(8, 1024, 8))
    assert g.config_for(6144, 4096, 1, 1, fp8=True) == g.GemvConfig(8, 1024, 8)
    assert g.config_for(6144, 4096, 1, 1) == g.TUNED[key]
    assert g.config_for(128256, 4096, 1, 1, fp8=True) == g.config_for(128256, 4096, 1, 1)  # the LM head: bf16
