"""The INT4 weight-only matmul (kernels/w4a16.py) against x @ dequantize_reference(...)ᵀ in fp32: one token, a few
(the decode tile) and more than 16 (the GEMM tile), groups of 32 and 128, both ways of loading a group's scale, split-K
partials, a bias, shapes that do not fill the tile; and the nibble order, which a reversed packing would break.

On the CPU the interpreter's bf16 tl.dot returns garbage (kernels/gemv.py's too), so bf16 runs the one-token path
there and every path on CUDA; fp16 and fp32 run every path everywhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from services.gpu_worker.kernels import w4a16 as w4
from tests.kernels.helpers import DEVICE, gpu_only, randn, rel_err


def _pack(q: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """[N, K] integers 0..15 → int32 [N, K // 8]: column 8j + i in bits 4i..4i+3 of word j (reverse: in nibble
    7 - i, the wrong order a converter could write)."""
    n, k = q.shape
    nibbles = q.to(torch.int64).reshape(n, k // 8, 8)
    if reverse:
        nibbles = nibbles.flip(-1)
    words = (nibbles << (4 * torch.arange(8, device=q.device))).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _quantized(n, k, group_size, dtype, seed):
    """Random 4-bit weights, scales ~ k^-0.5 / 8 and integer zero points 0..15 in `dtype`: (q [N, K], qweight,
    scales, zeros)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = ((torch.rand((n, k // group_size), generator=gen) + 0.5) * k ** -0.5 / 8).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group_size), generator=gen).to(dtype)
    return q.to(DEVICE), _pack(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def _reference(x, qweight, scales, zeros, group_size, bias=None):
    out = x.float() @ w4.dequantize_reference(qweight, scales, zeros, group_size).float().t()
    return out if bias is None else out + bias.float()


def _check(num_tokens, n, k, group_size, dtype, tol, bias=False, parts=1, config=None):
    _, qweight, scales, zeros = _quantized(n, k, group_size, dtype, seed=num_tokens * 7 + n + k + group_size)
    gen = torch.Generator().manual_seed(num_tokens)
    x = randn((num_tokens, k), gen, dtype, DEVICE)
    b = randn((n,), gen, dtype, DEVICE) if bias else None
    if parts == 1 and config is None:
        out = w4.w4a16_linear(x, qweight, scales, zeros, group_size, b)
    else:
        out = w4.w4a16_matmul(x, qweight, scales, zeros, group_size, b, parts, config)
    ref = _reference(x, qweight, scales, zeros, group_size, b)
    if parts > 1:
        assert out.shape == (parts, num_tokens, n) and out.dtype == torch.float32
        out = out.sum(0)
    else:
        assert out.shape == (num_tokens, n) and out.dtype == dtype
    assert rel_err(out, ref) < tol


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DOT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 40, w4.DEQUANT_MIN_TOKENS])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_w4a16_linear_matches_the_dequantized_matmul(num_tokens, group_size, dtype):
    _check(num_tokens, 64, 256, group_size, dtype, TOL[dtype])


@pytest.mark.parametrize("group_size", [32, 128])
def test_w4a16_one_token_in_bf16(group_size):
    _check(1, 64, 256, group_size, torch.bfloat16, TOL[torch.bfloat16])


@pytest.mark.parametrize("num_tokens,config", [
    (1, w4.W4A16Config(1, 8, 32, 4)),  # a block of K inside one group: one scale a row
    (1, w4.W4A16Config(1, 8, 64, 4)),  # spanning groups (a scale gathered per column); K = 96: a masked step
    (5, w4.W4A16Config(16, 16, 32, 4)),
    (5, w4.W4A16Config(16, 16, 128, 4)),  # wider than K = 96: masked columns and words
    (21, w4.W4A16Config(16, 32, 32, 4)),  # two M blocks, the last part-filled
])
def test_w4a16_tiles_that_do_not_fill_the_shape(num_tokens, config):
    # N = 40 fills 5 / 2.5 / 1.25 tiles; K = 96 is 3 groups of 32
    _check(num_tokens, 40, 96, 32, torch.float32, 1e-5, bias=True, config=config)


@pytest.mark.parametrize("num_tokens,block_m", [(1, 1), (4, 16)])
def test_w4a16_split_k_partials(num_tokens, block_m):
    # 4 parts of 2 groups of 32 each; partials summed outside, as kernels/gemv.py's
    _check(num_tokens, 24, 256, 32, torch.float32, 1e-5, parts=4, config=w4.W4A16Config(block_m, 16, 32, 4))


@pytest.mark.parametrize("num_tokens,config,parts", [
    (5, w4.W4A16Config(16, 16, 128, 4), 1),  # N = 40 fills 2.5 tiles of the group kernel
    (21, w4.W4A16Config(16, 32, 128, 4), 1),  # two M blocks, the last part-filled
    (3, w4.W4A16Config(16, 16, 128, 4), 3),  # 3 parts of 1 group each
])
def test_w4a16_group_kernel_tiles_and_parts(num_tokens, config, parts):
    # K = 384 is 3 groups of 128: the tensor-core kernel, a group a step
    _check(num_tokens, 40, 384, 128, torch.float32, 1e-5, bias=parts == 1, parts=parts, config=config)


@pytest.mark.parametrize("group_size", [32, 128])
def test_the_large_m_path_dequantizes_exactly(group_size):
    """w4a16_dequantize (the large-M path's float W, one kernel) equals the torch reference's dequantization, rows and
    columns that do not fill its 32 x 128 tile included."""
    _, qweight, scales, zeros = _quantized(40, 384, group_size, torch.float32, seed=5)
    out = w4.w4a16_dequantize(qweight, scales, zeros, group_size, torch.float32)
    assert torch.equal(out, w4.dequantize_reference(qweight, scales, zeros, group_size))


def test_split_for_fills_the_sms_with_whole_groups():
    cfg8 = w4.config_for(8, 4096, 4096, group_size=128)
    assert (cfg8.block_m, cfg8.block_n, cfg8.block_k) == (16, 64, 128)  # the group kernel
    # 64 tiles on 132 SMs: 5 parts would fill them twice; 32 groups split 4 ways
    assert w4.split_for(8, 4096, 4096, 128, cfg8, 132) == 4
    assert w4.split_for(8, 4096, 14336, 128, cfg8, 132) == 4  # 112 groups: 4 divides them
    assert w4.split_for(8, 4096, 3 * 128, 128, cfg8, 132) == 3  # 3 groups: at most 3
    assert w4.split_for(8, 28672, 4096, 128, cfg8, 132) == 1  # 448 tiles fill the SMs alone
    assert w4.split_for(1, 4096, 4096, 128, w4.config_for(1, 4096, 4096), 132) == 1  # 512 row tiles already


def test_w4a16_default_tiles():
    assert w4.config_for(1, 4096, 4096).block_m == 1
    for m in (2, 16):
        assert w4.config_for(m, 4096, 4096).block_m == w4.DECODE_MAX_TOKENS
    assert w4.config_for(17, 4096, 4096).block_m == 64 and w4.config_for(65, 4096, 4096).block_m == 128
    for m in (2, 16):  # published groups of 128 take the group kernel (block_k the group) up to 16 tokens, 32 the dot tile
        assert w4.config_for(m, 4096, 4096, group_size=128).block_k == 128
    for m in (2, 16, 17, 300):
        assert w4.config_for(m, 4096, 4096, group_size=32) == w4.config_for(m, 4096, 4096)
    assert w4.config_for(17, 4096, 4096, group_size=128) == w4.config_for(17, 4096, 4096)  # the group kernel stops at 16
    assert w4.is_group_tiled(128) and w4.is_group_tiled(256) and not w4.is_group_tiled(64)
    for m in (1, 8, 40, 512):
        for n, k in (4096, 4096), (14336, 4096), (4096, 14336), (64, 96):
            cfg = w4.config_for(m, n, k)
            assert cfg.block_k % w4.PACK == 0 and cfg.block_k <= max(16, 1 << (k - 1).bit_length())


def _compile_default_tiles_for_sm90(out_dir: str) -> None:
    """Compile the kernel at config_for's tiles (bf16, both ways of loading scales) for an H100 without one, and
    print one JSON line per tile: its registers and stack bytes a thread (cuobjdump), whether it uses wgmma. Run
    without TRITON_INTERPRET (python -m tests.kernels.test_w4a16 DIR): the interpreter's kernels do not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for m, k in (1, 4096), (1, 14336), (8, 4096), (40, 4096), (300, 4096):
        cfg = w4.config_for(m, 4096, k)
        # the one-token kernel gathers a scale per word; 8 tokens also on the group kernel (groups of 128), 300 also
        # on the dequantizing kernel of the large-M path
        variants = (None,) if m == 1 else (True, False, "group") if m <= 16 else (True, False, "dequant")
        for one_group in variants:
            if m == 1:
                fn = w4._w4a16_gemv_kernel
                consts = {"HAS_BIAS": True, "BLOCK_N": cfg.block_n, "BLOCK_W": cfg.block_k // w4.PACK, "EVEN_K": True}
            elif one_group == "group":
                cfg = w4.config_for(m, 4096, k, group_size=128)
                fn = w4._w4a16_group_kernel
                consts = {"HAS_BIAS": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "GROUP_W": 128 // w4.PACK,
                          "IEEE_DOT": False}
            elif one_group == "dequant":
                cfg = w4.W4A16Config(0, 32, 128, 4)  # w4a16_dequantize's tile; block_m 0: no dot
                fn = w4._w4a16_dequant_kernel
                consts = {"BLOCK_N": 32, "BLOCK_K": 128, "ONE_GROUP": True}
            else:
                fn = w4._w4a16_kernel
                consts = {"HAS_BIAS": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                          "ONE_GROUP": one_group, "IEEE_DOT": False}
            sig = {a: "constexpr" if a in consts else "*i32" if a == "q_ptr" else "*bf16" if a.endswith("_ptr")
                   else "i32" for a in fn.arg_names}
            src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            path = os.path.join(out_dir, f"m{m}_k{k}_{one_group}.cubin")
            with open(path, "wb") as f:
                f.write(kernel.asm["cubin"])
            usage = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True,
                                   check=True).stdout
            fields = dict(f.split(":") for f in next(line for line in usage.splitlines() if "REG:" in line).split())
            print(json.dumps({"m": m, "k": k, "block_m": cfg.block_m, "one_group": one_group, "reg": int(fields["REG"]),
                              "stack": int(fields["STACK"]), "local": int(fields["LOCAL"]),
                              "wgmma": "wgmma.mma_async" in kernel.asm["ptx"]}))


def _nvidia_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_CUOBJDUMP = _nvidia_tool("cuobjdump")


@pytest.mark.skipif(not all(os.path.exists(_nvidia_tool(t)) for t in ("ptxas", "cuobjdump")),
                    reason="Triton's NVIDIA backend tools are missing")
def test_the_default_tiles_compile_for_sm90_without_spilling(tmp_path):
    """No GPU needed: the kernel lowers through ptxas for sm_90 at each default tile, keeps within 255 registers a
    thread without a stack (no spills), and the prefill tiles use the Hopper tensor cores (wgmma)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-m", "tests.kernels.test_w4a16", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    tiles = [json.loads(line) for line in run.stdout.splitlines()]
    # one token at two widths of K; 8, 40 and 300 tokens with each way of loading scales; the group kernel (8 tokens)
    # and the dequantizing kernel (40, 300)
    assert len(tiles) == 11
    for tile in tiles:
        assert tile["stack"] == 0 and tile["local"] == 0, tile
        assert tile["wgmma"] == (tile["block_m"] >= 64), tile


@pytest.mark.parametrize("group_size", [32, 128])  # the dequantizing tiles; the group kernel past one token
def test_the_nibble_order_is_k_8j_plus_i(group_size):
    """Weights whose nibbles differ at every position of a word (scale 1, zero 0): x = rows of the identity read
    columns of W back exactly on each path, and the same integers packed in the reverse nibble order do not."""
    n, k = 16, 256
    q = ((torch.arange(k)[None, :] % 8) * 2 + (torch.arange(n)[:, None] % 2)).to(DEVICE)  # 0..15, distinct per i
    scales = torch.ones((n, k // group_size), device=DEVICE)
    zeros = torch.zeros((n, k // group_size), device=DEVICE)
    right, wrong = _pack(q), _pack(q, reverse=True)
    assert torch.equal(w4.unpack_reference(right), q.to(torch.int32))
    assert torch.equal(w4.dequantize_reference(right, scales, zeros, group_size), q.float())
    assert not torch.equal(w4.dequantize_reference(wrong, scales, zeros, group_size), q.float())
    eye = torch.eye(k, device=DEVICE)
    for cols in ([5], list(range(3, 19)), list(range(k))):  # one token, the decode tile, the GEMM tile
        x = eye[cols]
        assert torch.equal(w4.w4a16_linear(x, right, scales, zeros, group_size), q[:, cols].t().float())
        assert not torch.equal(w4.w4a16_linear(x, wrong, scales, zeros, group_size), q[:, cols].t().float())


def test_a_wrong_nibble_order_fails_the_reference_check():
    q, qweight, scales, zeros = _quantized(32, 128, 32, torch.float32, seed=3)
    x = randn((3, 128), torch.Generator().manual_seed(3), torch.float32, DEVICE)
    ref = _reference(x, qweight, scales, zeros, 32)
    assert rel_err(w4.w4a16_linear(x, qweight, scales, zeros, 32), ref) < 1e-5
    assert rel_err(w4.w4a16_linear(x, _pack(q.cpu(), reverse=True).to(DEVICE), scales, zeros, 32), ref) > 0.1


def test_w4a16_rejects_what_it_cannot_compute():
    _, qweight, scales, zeros = _quantized(8, 64, 32, torch.float32, seed=0)
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="group_size"):
        w4.w4a16_linear(x, qweight, scales, zeros, 12)
    with pytest.raises(ValueError, match="scales"):
        w4.w4a16_linear(x, qweight, scales[:, :1], zeros, 32)
    with pytest.raises(ValueError, match="int32"):
        w4.w4a16_linear(x, qweight.to(torch.int64), scales, zeros, 32)
    with pytest.raises(ValueError, match="parts"):
        w4.w4a16_matmul(x, qweight, scales, zeros, 32, parts=3)
    with pytest.raises(ValueError, match="block_m 1"):
        w4.w4a16_matmul(x, qweight, scales, zeros, 32, config=w4.W4A16Config(1, 8, 32, 4))
    with pytest.raises(ValueError, match="x"):
        w4.w4a16_linear(x[:0], qweight, scales, zeros, 32)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 8, 16, 17, 200, 300])
@pytest.mark.parametrize("n,k,group_size", [(6144, 4096, 128), (28672, 4096, 128), (4096, 14336, 128),
                                            (4096, 4096, 32), (4096, 14336, 14336)])
def test_w4a16_llama8b_shapes(num_tokens, n, k, group_size):
    _check(num_tokens, n, k, group_size, torch.bfloat16, 1e-2)
    _check(num_tokens, n, k, group_size, torch.float16, 2e-3)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("n,k,group_size", [(6144, 4096, 128), (28672, 4096, 128), (4096, 14336, 128),
                                            (4096, 4096, 32)])
def test_w4a16_one_token_scales_by_chunk_llama8b_shapes(n, k, group_size, monkeypatch):
    monkeypatch.setattr(w4, "CHUNK_SCALES", True)
    _check(1, n, k, group_size, torch.bfloat16, 1e-2)
    _check(1, n, k, group_size, torch.float16, 2e-3)


@pytest.mark.gpu
@gpu_only
def test_w4a16_under_a_cuda_graph():
    """The decode path as the engine's captured steps would run it: no host synchronisation inside the call."""
    _, qweight, scales, zeros = _quantized(4096, 4096, 128, torch.bfloat16, seed=1)
    x = randn((1, 4096), torch.Generator().manual_seed(1), torch.bfloat16, DEVICE)
    w4.w4a16_linear(x, qweight, scales, zeros, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4.w4a16_linear(x, qweight, scales, zeros, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _reference(x, qweight, scales, zeros, 128)) < 1e-2


if __name__ == "__main__":
    _compile_default_tiles_for_sm90(sys.argv[1])


@pytest.mark.parametrize("group_size,k,config,parts", [
    (32, 96, w4.W4A16Config(1, 8, 64, 4), 1),  # a chunk of 4 words a group; K = 96: a masked second step; N = 40
    (32, 256, w4.W4A16Config(1, 16, 32, 4), 4),  # 4 parts of 2 groups, one chunk a step
    (128, 384, w4.W4A16Config(1, 8, 256, 4), 1),  # 3 groups of 4 chunks in steps of 8 chunks: the last masked
    (128, 512, w4.W4A16Config(1, 4, 2048, 4), 2),  # a step wider than the part: chunks past its end masked
])
def test_w4a16_one_token_scales_by_chunk(group_size, k, config, parts, monkeypatch):
    """CHUNK_SCALES: a scale and zero loaded once a chunk of 4 words (_w4a16_gemv_chunks); the same sums."""
    monkeypatch.setattr(w4, "CHUNK_SCALES", True)
    assert w4.chunks_fit(group_size, config.block_k)
    _check(1, 40, k, group_size, torch.float32, 1e-5, bias=parts == 1, parts=parts, config=config)
    _check(1, 40, k, group_size, torch.bfloat16, 1e-2, parts=parts, config=config)


def test_chunks_fit_only_whole_chunks_of_a_group():
    assert w4.chunks_fit(128, 2048) and w4.chunks_fit(32, 32)
    assert not w4.chunks_fit(16, 2048)  # a group of 2 words: a chunk would span groups
    assert not w4.chunks_fit(128, 16)  # a step of 2 words
