"""CPU micro-benchmark of an eager step's host inputs: what model_runner.forward builds before the GPU can start.

A W1-sized mixed step by default: 368 decodes at ~1,500 tokens of context and one 8,192-token prefill chunk of a
fresh 8,192-token prompt. Times, per step, the input lists (model_runner.eager_inputs), the page table and their
conversion to tensors two ways: `torch.tensor(list)` as staging.to_device did before (nested lists for the table)
and the numpy path it takes now (the table built row by row in an int32 array). On a CUDA machine the conversion is
followed by the pinned copy; here (CPU) it ends at the host tensor, which is the part that differs.

    python -m bench.host_inputs --out bench/results/host_inputs_cpu_$(date +%Y%m%d).json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types
from pathlib import Path

import numpy as np
import torch

from services.gpu_worker.model_runner import eager_inputs
from services.gpu_worker.staging import to_device

PAGE_SIZE = 16


def mixed_step(num_decodes: int, context: int, chunk: int) -> list:
    """Stand-ins for ScheduledItems: decodes of `context` tokens, then a first prefill chunk of `chunk` tokens."""
    params = types.SimpleNamespace(max_tokens=1000)

    def item(num_tokens: int, start: int, new: int, sampling: bool):
        seq = types.SimpleNamespace(token_ids=list(range(num_tokens)), num_computed=start, draft_token_ids=[],
                                    page_ids=list(range(1, -(-num_tokens // PAGE_SIZE) + 1)), params=params)
        return types.SimpleNamespace(seq=seq, num_new_tokens=new, num_draft_tokens=0, is_sampling=sampling)

    return [item(context, context - 1, 1, True) for _ in range(num_decodes)] + [item(chunk, 0, chunk, False)]


def lists_way(items: list) -> list[torch.Tensor]:
    ids, positions, slots, query_start, seq_lens, _ = eager_inputs(items, PAGE_SIZE)
    widest = max(len(it.seq.page_ids) for it in items)
    table = [it.seq.page_ids + [0] * (widest - len(it.seq.page_ids)) for it in items]
    return [torch.tensor(v, dtype=d) for v, d in ((ids, torch.long), (positions, torch.int32),
                                                   (slots, torch.int32), (query_start, torch.int32),
                                                   (seq_lens, torch.int32), (table, torch.int32))]


def numpy_way(items: list) -> list[torch.Tensor]:
    ids, positions, slots, query_start, seq_lens, _ = eager_inputs(items, PAGE_SIZE)
    widest = max(len(it.seq.page_ids) for it in items)
    table = np.zeros((len(items), widest), dtype=np.int32)
    for i, it in enumerate(items):
        table[i, :len(it.seq.page_ids)] = it.seq.page_ids
    return [to_device(v, d, "cpu") for v, d in ((ids, torch.long), (positions, torch.int32), (slots, torch.int32),
                                                (query_start, torch.int32), (seq_lens, torch.int32),
                                                (table, torch.int32))]


def time_ms(fn, items: list, repeats: int) -> list[float]:
    fn(items)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(items)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-decodes", type=int, default=368)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    items = mixed_step(args.num_decodes, args.context, args.chunk)
    assert all(torch.equal(a, b) for a, b in zip(lists_way(items), numpy_way(items), strict=True))
    lists, arrays = time_ms(lists_way, items, args.repeats), time_ms(numpy_way, items, args.repeats)
    result = {"bench": "host_inputs", "command": "python -m bench.host_inputs " + " ".join(argv or []),
              "date": time.strftime("%Y-%m-%d"), "platform": platform.platform(), "torch": torch.__version__,
              "num_decodes": args.num_decodes, "context": args.context, "chunk": args.chunk,
              "median_ms": {"torch_tensor_of_lists": round(statistics.median(lists), 3),
                            "numpy": round(statistics.median(arrays), 3)},
              "all_ms": {"torch_tensor_of_lists": [round(x, 3) for x in lists],
                         "numpy": [round(x, 3) for x in arrays]}}
    print(json.dumps(result["median_ms"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
