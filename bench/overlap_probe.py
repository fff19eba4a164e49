"""Would two micro-batches on two CUDA streams overlap a decode step's GEMMs with its attention? A probe, before
building it into the engine (issue 24: W1 in bf16 cannot reach 12k tok/s on the H200 with the two run one after
the other; docs/PERFORMANCE.md, "Bounds").

A decode step of Llama-3.1-8B's shapes (random bf16 weights, 32 layers, each with its own weights; one paged bf16
KV cache of `--context` tokens a sequence shared by the layers, far larger than L2) at `--batch` sequences: per
layer the qkv GEMM, the engine's decode attention kernel, o, gate_up, SiLU·mul, down. Each variant is captured in
one CUDA graph and timed as GPU work (bench.timing.time_gpu):
- `whole`: the batch as one, on one stream (what the engine runs today);
- `halves_one_stream`: the batch in two micro-batches, one after the other on one stream (the cost of splitting:
  smaller GEMMs);
- `halves_two_streams`: the two micro-batches on two streams, the second started once the first's first qkv GEMM
  is done, so that one's attention meets the other's GEMMs;
- `split128_two_streams`: as above, split at a multiple of 128 rows (cuBLAS's tile) instead of in half.
The two-stream outputs are checked against the one-stream ones (the same kernels on the same inputs: equal).

    python -m bench.overlap_probe --batch 368 256 --context 1500 --out $OUT/overlap.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from bench.timing import copy_bandwidth, graph_of, time_gpu

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 4096, 32, 8, 128, 14336, 32
PAGE = 16


class Layer:
    def __init__(self, dtype):
        kw = dict(device="cuda", dtype=dtype)
        s = 0.02
        self.qkv = torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, **kw) * s
        self.o = torch.randn(HIDDEN, HEADS * HEAD_DIM, **kw) * s
        self.gate_up = torch.randn(2 * INTER, HIDDEN, **kw) * s
        self.down = torch.randn(HIDDEN, INTER, **kw) * s


def make_step(layers, k_cache, v_cache, table, lens, x, out):
    """fn() running the 32 layers over x's rows (their page-table rows and lengths: table, lens), into out."""
    from services.gpu_worker.kernels.decode_attention import decode_attention, num_splits_for

    rows = x.shape[0]
    splits = num_splits_for(rows, KV_HEADS, torch.cuda.get_device_properties(0).multi_processor_count)

    def fn():
        h = x
        for layer in layers:
            qkv = F.linear(h, layer.qkv)
            q = qkv[:, :HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
            attn = decode_attention(q, k_cache, v_cache, table, lens, splits)
            h2 = F.linear(attn.view(rows, -1), layer.o) + h
            gu = F.linear(h2, layer.gate_up)
            act = F.silu(gu[:, :INTER]) * gu[:, INTER:]
            h = F.linear(act, layer.down) + h2
        out.copy_(h)
    return fn


def probe(batch: int, context: int, layers, dtype) -> dict:
    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq + 1
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = (1 + torch.randperm(num_pages - 1, device="cuda")[:batch * pages_per_seq]).view(batch, pages_per_seq)
    table = table.to(torch.int32).contiguous()
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    x = torch.randn(batch, HIDDEN, device="cuda", dtype=dtype)
    out_whole = torch.empty_like(x)
    result = {"batch": batch, "context": context, "kv_gb_per_layer": k_cache.numel() * 2 * k_cache.element_size() / 1e9}

    whole = graph_of(make_step(layers, k_cache, v_cache, table, lens, x, out_whole))
    result["whole_ms"] = time_gpu(whole.replay) * 1e3

    def split_variants(cut: int, tag: str):
        parts = [(0, cut), (cut, batch)]
        outs = [torch.empty(b - a, HIDDEN, device="cuda", dtype=dtype) for a, b in parts]
        fns = [make_step(layers, k_cache, v_cache, table[a:b], lens[a:b], x[a:b], o) for (a, b), o in zip(parts, outs)]

        def one_stream():
            fns[0]()
            fns[1]()
        g1 = graph_of(one_stream)
        g1.replay()
        torch.cuda.synchronize()
        ref = [o.clone() for o in outs]
        side = torch.cuda.Stream()
        first_gemm_done = torch.cuda.Event()

        def two_streams():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            # the second micro-batch starts after a qkv GEMM of the first's size (counted in this variant's time, an
            # over-estimate of its cost), so the two run out of phase: one's attention against the other's GEMMs
            F.linear(x[:cut], layers[0].qkv)
            first_gemm_done.record(main)
            with torch.cuda.stream(side):
                side.wait_event(first_gemm_done)
                fns[1]()
            fns[0]()
            main.wait_stream(side)
        g2 = graph_of(two_streams)
        for o in outs:
            o.zero_()
        g2.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(ref, outs))
        if tag == "halves":
            result["halves_one_stream_ms"] = time_gpu(g1.replay) * 1e3
        result[f"{tag}_two_streams_ms"] = time_gpu(g2.replay) * 1e3
        result[f"{tag}_two_streams_equal"] = same
        result[f"{tag}_rows"] = [b - a for a, b in parts]

    split_variants(batch // 2, "halves")
    cut = max(128, (batch // 2) // 128 * 128)
    if 0 < cut < batch and cut != batch // 2:
        split_variants(cut, "split128")
    result["two_streams_over_whole"] = result["halves_two_streams_ms"] / result["whole_ms"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[368, 256])
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("overlap_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layers = [Layer(dtype) for _ in range(LAYERS)]
    report = {"device": torch.cuda.get_device_name(0), "copy_tb_s": copy_bandwidth(), "runs": []}
    for batch in args.batch:
        r = probe(batch, args.context, layers, dtype)
        print(json.dumps(r), flush=True)
        report["runs"].append(r)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
