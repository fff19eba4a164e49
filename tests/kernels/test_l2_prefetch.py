"""The L2 prefetch of weights (kernels/l2_prefetch.py): which bytes it asks for, when the forward asks, that the
kernel compiles to Hopper's prefetch instructions, and that it changes no bit.

On the CPU the plan and the forward's order of requests are checked with a recording prefetcher, and the kernel is
compiled for sm_90 and read back (a subprocess: this suite's kernels run under TRITON_INTERPRET, which does not
compile). On the GPU the whole forward's graph gives the same logits with and without, and the engine the same
tokens."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.kernels import l2_prefetch
from services.gpu_worker.kernels.l2_prefetch import PrefetchConfig, Region, plan
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams
from tests.kernels.helpers import assert_switch_keeps_every_bit, gpu_only

ROOT = Path(__file__).resolve().parents[2]
needs_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and l2_prefetch.supported("cuda")),
                                  reason="needs a CUDA device of compute capability >= 9.0")


def _bytes_of(region: Region) -> set[int]:
    """Every byte offset the region covers, chunk by chunk, as the kernel computes them."""
    got = set()
    for r in range(region.rows):
        for s in range(region.segments):
            for c in range(region.chunks_per_seg):
                start = r * region.row_bytes + s * region.seg_stride + c * region.chunk
                got.update(range(start, start + region.chunk))
    return got


def test_cols_takes_the_leading_bytes_of_each_split_k_slice_of_every_row():
    # o_proj [4096, 4096] bf16 read as 4 slices of K: 1 MiB is 4096 rows x 4 slices x 64 bytes, so one 64-byte chunk
    region = plan((4096, 4096), 2, 1 << 20, "cols", segments=4, chunk=64)
    assert region == Region(rows=4096, segments=4, chunks_per_seg=1, chunk=64, row_bytes=8192, seg_stride=2048)
    assert region.nbytes == 1 << 20
    small = plan((4, 64), 2, 4 * 4 * 32, "cols", segments=4, chunk=16)  # 4 rows of 128 bytes, slices of 32
    want = {r * 128 + s * 32 + b for r in range(4) for s in range(4) for b in range(32)}
    assert _bytes_of(small) == want
    half = plan((4, 64), 2, 4 * 4 * 16, "cols", segments=4, chunk=16)  # the first half of each slice only
    assert _bytes_of(half) == {r * 128 + s * 32 + b for r in range(4) for s in range(4) for b in range(16)}


def test_cols_never_asks_past_a_slice_and_rows_take_the_leading_bytes():
    capped = plan((8, 64), 2, 1 << 30, "cols", segments=2, chunk=16)  # far more than the matrix
    assert capped.nbytes == 8 * 128 and _bytes_of(capped) == set(range(8 * 128))
    rows = plan((100, 4096), 2, 3 * 8192 + 5000, "rows", chunk=4096)  # whole chunks of the first bytes
    assert (rows.rows, rows.segments, rows.chunks_per_seg, rows.nbytes) == (1, 1, 7, 7 * 4096)
    assert _bytes_of(rows) == set(range(7 * 4096))
    whole = plan((4, 64), 2, 1 << 30, "rows", chunk=64)  # never past the matrix
    assert _bytes_of(whole) == set(range(4 * 128))
    assert plan((100, 4096), 2, 4095, "rows", chunk=4096) is None  # less than one chunk
    assert plan((4096, 4096), 2, 1000, "cols", segments=4) is None  # less than a chunk per row and slice
    assert plan((3, 40), 2, 1 << 20, "cols", segments=3, chunk=16).segments == 1  # 80 bytes: not 3 equal slices


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="layout"):
        plan((4, 64), 2, 1024, "diagonal")
    with pytest.raises(ValueError, match="multiple of 16"):
        plan((4, 64), 2, 1024, "cols", chunk=24)
    with pytest.raises(ValueError, match="bad prefetch config"):
        PrefetchConfig(gemms=("qkv", "attention"))
    with pytest.raises(ValueError, match="layout"):
        PrefetchConfig(mode="tma")
    with pytest.raises(ValueError, match="l2_prefetch must be"):
        EngineConfig(l2_prefetch="yes")


def test_auto_is_off_on_the_cpu_and_on_is_refused_there():
    assert l2_prefetch.resolve("auto", "cpu") is False and l2_prefetch.resolve("off", "cpu") is False
    with pytest.raises(ValueError, match="compute capability"):
        l2_prefetch.resolve("on", "cpu")


class _Recorder:
    """Stands for an L2Prefetcher: records what the forward asks for and which kernels ran before each request."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.calls: list[tuple[str, int, int]] = []
        self.joins = 0

    def active(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def issue(self, gemm: str, weight: torch.Tensor, segments: int = 1) -> None:
        self.calls.append((gemm, weight.data_ptr(), segments))

    def join(self) -> None:
        self.joins += 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's fused path")
def test_the_forward_asks_for_each_gemm_weight_in_order_and_joins_once():
    from services.gpu_worker.model import fused

    config = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32", num_pages=64,
                          attention_backend="triton")
    engine = Engine(config, loaded=load_model("random:tiny-llama", dtype=torch.float32, seed=1))
    model = engine.model
    assert model.is_fused and model.l2_prefetcher is None  # "off" by default, and never on the CPU
    rec = _Recorder(max_tokens=4)
    model.l2_prefetcher = rec
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], params)  # a 9-token prefill (inactive), then 1-token decodes
    parts = fused.SPLIT_K_PARTS
    per_step = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        per_step += [("qkv", attn.qkv_weight.data_ptr(), 1), ("o", attn.o_proj.weight.data_ptr(), parts),
                     ("gate_up", mlp.gate_up_weight.data_ptr(), 1), ("down", mlp.down_proj.weight.data_ptr(), parts)]
    head = model.lm_head.weight if hasattr(model, "lm_head") else model.model.embed_tokens.weight
    per_step.append(("lm_head", head.data_ptr(), 1))
    assert len(rec.calls) == 3 * len(per_step) and rec.joins == 3  # three decode steps; not the prefill
    assert rec.calls == per_step * 3


def _sass_opcodes(mode: str) -> collections.Counter:
    script = f"""
import json, subprocess, tempfile, re, collections
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from services.gpu_worker.kernels import l2_prefetch
k = l2_prefetch._prefetch_kernel
names = k.arg_names
const = {{"CHUNKS_PER_SEG": 2, "NUM_SEGS": 4, "CHUNK": 256, "BLOCK": 128, "BULK": {mode != "lines"},
         "EVICT_LAST": {mode == "bulk_last"}}}
sig = {{n: "constexpr" if n in const else "*u8" if n == "base_ptr" else "*i32" if n == "sink_ptr" else "i32"
       for n in names}}
src = ASTSource(k, sig, constexprs={{(names.index(a),): v for a, v in const.items()}})
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
print(c.asm["cubin"].hex())
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    nvdisasm = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(bytes.fromhex(out.stdout.strip().splitlines()[-1]))
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return collections.Counter(m.group(1).split()[0] for m in
                               re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?(.*?)\s*;", sass))


def test_the_kernel_compiles_to_hoppers_prefetch_instructions():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this Triton wheel has no nvdisasm")
    bulk, last, lines = _sass_opcodes("bulk"), _sass_opcodes("bulk_last"), _sass_opcodes("lines")
    assert bulk["UBLKPF.L2"] > 0 and not any(op.startswith("LDG") for op in bulk)  # a bulk prefetch, no loads
    assert last["UBLKPF.L2"] > 0 and sum(last.values()) > sum(bulk.values())  # and its cache policy's set-up
    assert lines["CCTL.E.PML2"] > 0 and not any(op.startswith("LDG") for op in lines)  # per-line, evict-last
    assert "UBLKPF.L2" not in lines


@pytest.mark.gpu
@needs_hopper
def test_the_forward_graph_gives_the_same_logits_with_the_prefetch():
    """The whole forward + LM head captured in a graph at 1 and 4 tokens (split-K on), each prefetch layout and
    mode against none: the same bits, KV writes included."""
    from bench.h200_probe import Batch, graph_of  # a hand-built paged batch, and a captured graph of a call
    from services.gpu_worker.model import fused

    config = EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16", num_pages=256,
                          max_num_seqs=4, enable_cuda_graphs=False)
    engine = Engine(config, loaded=load_model("random:qwen3-0.6b", dtype=torch.bfloat16, device="cuda", seed=5))
    model, kv, backend = engine.model, engine.kv, engine.backend
    kv.k.normal_(0, 1)
    kv.v.normal_(0, 1)
    start = (kv.k.clone(), kv.v.clone())
    batches = {batch: Batch(batch, 100, 1, 16, "cuda") for batch in (1, 4)}  # NOTE: random input ids, made once
    outs = {}
    for label, pcfg in (("off", None), ("cols", PrefetchConfig(mib=1)), ("rows", PrefetchConfig(mib=1, layout="rows")),
                        ("lines", PrefetchConfig(mib=1, mode="lines")),
                        ("last", PrefetchConfig(mib=1, layout="rows", mode="bulk_last", chunk=65536))):
        for batch, mb in batches.items():
            model.l2_prefetcher = None if pcfg is None else l2_prefetch.L2Prefetcher(pcfg, "cuda")
            captured = {}
            with torch.inference_mode():
                g = graph_of(lambda: captured.__setitem__(
                    "x", model.logits(fused.forward(model, mb.input_ids, mb.positions, kv, mb.meta, backend))))
                g.replay()
            torch.cuda.synchronize()
            outs[label, batch] = (captured["x"].clone(), kv.k.clone(), kv.v.clone())
            kv.k.copy_(start[0])
            kv.v.copy_(start[1])
    model.l2_prefetcher = None
    for (label, batch), got in outs.items():
        for x, y in zip(got, outs["off", batch]):
            assert torch.equal(x, y), (label, batch)


@pytest.mark.gpu
@gpu_only
@needs_hopper
def test_engine_gives_the_same_tokens_and_logprobs_with_and_without_the_prefetch():
    loaded = load_model("random:qwen3-0.6b", dtype=torch.bfloat16, device="cuda", seed=3)

    def check(engine, mode):
        assert (engine.model.l2_prefetcher is not None) == (mode == "on")

    assert_switch_keeps_every_bit(loaded, "l2_prefetch", check)
