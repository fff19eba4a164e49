"""What bounds the INT4 one-token kernel (kernels/w4a16.py's _w4a16_gemv_kernel, issue 25): the same kernel with one
part of its work taken out at a time, on Llama-3.1-8B's projections, timed as kernel_table times rows (each call over
its own inputs inside one CUDA graph, L2 flushed before each replay).

The kernel reads at 0.29-0.41 of copy bandwidth on an H100, and two rewrites with fewer loads and barriers a word
(the group kernels in docs/PERFORMANCE.md's levers tried) were slower; so before another rewrite, this says which
part costs the time. Variants, each a constexpr switch of one probe kernel (the word kernel's loop, verbatim but for
the switch):

    full       the kernel as served (the probe's copy; its error against the dequantized matmul is checked)
    no_x       x[8j + i] a constant instead of eight strided loads and a shared-memory exchange a step
    no_scales  the word's scale and zero constants instead of gathered per word
    no_math    each word added to the accumulator as a float (the loads kept live, no unpacking or products)
    loads      no_x, no_scales and no_math together: the words' loads alone, the kernel's floor at this tile

    python -m bench.w4a16_probe --out $OUT

Prints and writes w4a16_probe.json: per projection and variant, µs and fraction of copy bandwidth."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.kernel_table import LLAMA3_8B, gemv_shapes
from bench.timing import copy_bandwidth, graph_of, time_gpu
from services.gpu_worker.kernels import w4a16 as w4

# (N, K) of Llama-3.1-8B's projections as kernel_table takes them (the LM head stays dense when quantized)
SHAPES = {name: (n, k) for name, n, k, _ in gemv_shapes(LLAMA3_8B) if name != "lm_head"}
GROUP = 128
VARIANTS = {"full": (0, 0, 0), "no_x": (1, 0, 0), "no_scales": (0, 1, 0), "no_math": (0, 0, 1), "loads": (1, 1, 1)}
BYTES_PER_GRAPH = 256 << 20


@triton.jit
def _probe_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, stride_qn, stride_sn,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, NO_X: tl.constexpr, NO_SCALES: tl.constexpr,
                  NO_MATH: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    words_per_group = group_size // 8
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, K // 8, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        words = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask_n[:, None], other=0,
                        eviction_policy="evict_first")
        if NO_SCALES:
            s = 1.0
            z = 0.0
        else:
            g_off = offs_n[:, None] * stride_sn + (offs_w // words_per_group)[None, :]
            s = tl.load(s_ptr + g_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
        if NO_MATH:
            acc += words.to(tl.float32) * s - z
        else:
            high = words >> 12
            dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            xsum = tl.zeros([BLOCK_W], dtype=tl.float32)
            for i in tl.static_range(8):
                if NO_X:
                    xi = tl.full([BLOCK_W], 0.5 + i, tl.float32)
                else:
                    xi = tl.load(x_ptr + offs_w * 8 + i).to(tl.float32)
                dot += w4._nibble(words, high, i) * xi[None, :]
                xsum += xi
            acc += s * (dot - z * xsum[None, :])
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=mask_n)


def probe(x, qweight, scales, zeros, out, block_n: int, block_k: int, flags: tuple) -> torch.Tensor:
    n, k = qweight.shape[0], x.shape[-1]
    _probe_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, out, n, k, GROUP, qweight.stride(0), scales.stride(0), BLOCK_N=block_n,
        BLOCK_W=block_k // 8, NO_X=flags[0], NO_SCALES=flags[1], NO_MATH=flags[2], num_warps=4, num_stages=1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tile", default="8x2048", help="rows x columns a step (kernels/w4a16.config_for's at one token)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("w4a16_probe needs a CUDA device", file=sys.stderr)
        return 2
    block_n, block_k = (int(v) for v in args.tile.split("x"))
    copy_tbs = copy_bandwidth()
    record = {"command": "python -m bench.w4a16_probe " + " ".join(sys.argv[1:]), "hardware":
              torch.cuda.get_device_name(), "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
              "copy_tb_s": round(copy_tbs, 3), "tile": [block_n, block_k], "rows": {}}
    for name, (n, k) in SHAPES.items():
        num_bytes = n * k // 2 + 2 * n * (k // GROUP) * 2 + k * 2 + n * 2
        calls = max(2, min(64, -(-BYTES_PER_GRAPH // num_bytes)))
        sets = []
        for i in range(calls):
            gen = torch.Generator(device="cuda").manual_seed(i)
            x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16, generator=gen)
            qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device="cuda",
                                    generator=gen)
            scales = (torch.rand((n, k // GROUP), device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            zeros = torch.randint(0, 16, (n, k // GROUP), device="cuda", generator=gen).to(torch.bfloat16)
            sets.append((x, qweight, scales, zeros, torch.empty((1, n), device="cuda", dtype=torch.bfloat16)))
        x, qweight, scales, zeros, out = sets[0]
        ref = x.float() @ w4.dequantize_reference(qweight, scales, zeros, GROUP).float().t()
        got = probe(x, qweight, scales, zeros, out, block_n, block_k, VARIANTS["full"]).float()
        err = float((got - ref).norm() / ref.norm())
        for variant, flags in VARIANTS.items():
            graph = graph_of(lambda: [probe(*s, block_n, block_k, flags) for s in sets])
            us = time_gpu(graph.replay, warmup=10, rep=100) / calls * 1e6
            row = {"us": round(us, 2), "of_copy": round(num_bytes / (us * 1e-6) / 1e12 / copy_tbs, 3),
                   "bytes": num_bytes, "calls": calls}
            if variant == "full":
                row["rel_err"] = float(f"{err:.3g}")
            record["rows"][f"{name}_{variant}"] = row
            print(f"{name:8s} {variant:10s} {row['us']:8.2f} us  {row['of_copy']:.3f} of copy", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "w4a16_probe.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
