"""Exact output lengths of ignore_eos requests, per KV-cache dtype: the check behind issue 24, item 4.

Runs the worker's engine thread (EngineLoop) in this process, as `radixserve serve` builds it (prefix cache on,
overlap mode and CUDA graphs on CUDA), feeds it `--num-requests` random-id prompts with ignore_eos and
`max_tokens = --output-len`, and folds every TokenBatch through the tokenizer's per-sample detokenizer state and
the gateway's RequestOutput, the two places usage.completion_tokens is counted. Prints, per KV dtype, the
requests whose engine-side or usage-side count is not `--output-len`, their finish reasons, and how many sampled
rows had a non-finite logit and which special ids (eos, out of vocab) came out.

    python -m bench.exact_lengths_gpu --out $OUT                       # H200: random:llama3-8b, 512 x 1000 -> 1000
    python -m bench.exact_lengths_gpu --model random:tiny-llama --device cpu --num-requests 24 \\
        --input-len 40 --output-len 30 --max-num-seqs 8 --chunk 64 --num-pages 96   # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import queue
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.gateway.responses import RequestOutput
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.engine_loop import AddCommand, EngineLoop, Envelope, WorkerIdentity
from services.tokenizer.detokenizer import SampleDetokenizer
from shared.messages import GenerateChunk, RequestFinished, SamplingSpec, TokenBatch, TokenizedRequest

REPLY_ADDR = "ipc://exact-lengths"


@dataclass
class LogitWatch:
    """Counts over every sampled row: rows with a NaN/inf logit, and argmax ids that are eos or outside the vocab."""

    eos_ids: frozenset[int]
    vocab_size: int
    num_rows: int = 0
    num_nonfinite_rows: int = 0
    special_ids: Counter = field(default_factory=Counter)

    def wrap(self, engine: Engine) -> None:
        forward = engine._forward

        def watched(plan):
            logits, greedy = forward(plan)
            if logits.shape[0]:
                finite = torch.isfinite(logits).all(dim=-1)  # [B]
                ids = (greedy if greedy is not None else logits.argmax(dim=-1)).tolist()
                self.num_rows += logits.shape[0]
                self.num_nonfinite_rows += int((~finite).sum())
                self.special_ids.update(i for i in ids if i in self.eos_ids or not 0 <= i < self.vocab_size)
            return logits, greedy

        engine._forward = watched


@dataclass
class Tally:
    """One request as the tokenizer and the gateway see it."""

    sample: SampleDetokenizer
    output: RequestOutput
    num_engine_tokens: int = 0
    engine_finish: str | None = None
    is_done: bool = False


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = 1000 if vocab > 2000 else 4  # the bench client's MIN_ID_TOKEN on real vocabularies
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(num)]


def _fold(batch: TokenBatch, tallies: dict[str, Tally]) -> None:
    """What the tokenizer (_on_output/_chunk) and the gateway (RequestOutput.add) do with one TokenBatch."""
    for out in batch.outputs:
        tally = tallies[out.request_id]
        tally.num_engine_tokens += len(out.token_ids)
        tally.engine_finish = out.finish_reason or tally.engine_finish
        if tally.sample.is_finished:
            continue
        step = tally.sample.step(out.token_ids, is_final=out.finish_reason is not None)
        chunk = GenerateChunk(request_id=out.request_id, index=out.index, text=step.text,
                              token_ids=out.token_ids[:step.num_tokens], logprobs=None, token_texts=None,
                              finish_reason="stop" if step.is_stopped else out.finish_reason,
                              num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens)
        if chunk.text or chunk.token_ids or chunk.finish_reason:
            tally.output.add(chunk)


def run_dtype(args: argparse.Namespace, kv_dtype: str) -> dict:
    config = EngineConfig(model=args.model, device=args.device, kv_cache_dtype=kv_dtype, page_size=args.page_size,
                          num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.chunk, enable_prefix_cache=not args.no_prefix_cache,
                          enable_overlap=args.overlap, seed=args.seed)
    engine = Engine(config)
    vocab = engine.model_config.vocab_size
    watch = LogitWatch(frozenset(engine.model_config.eos_token_ids), vocab)
    if args.watch_logits:
        watch.wrap(engine)
    delivered: queue.SimpleQueue[Envelope] = queue.SimpleQueue()
    loop = EngineLoop(engine, WorkerIdentity("w0", "ipc://w0", "inc", ""),
                      lambda envs: [delivered.put(e) for e in envs])
    loop.start()
    spec = SamplingSpec(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    tallies: dict[str, Tally] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(_prompts(args.num_requests, args.input_len, vocab, args.seed)):
        request_id = f"{kv_dtype}-{i}"
        tallies[request_id] = Tally(SampleDetokenizer(None), RequestOutput(1))
        loop.submit(AddCommand(TokenizedRequest(request_id, prompt, [], spec, REPLY_ADDR, time.time())))
        if args.stagger_s:
            time.sleep(args.stagger_s)
    num_done = 0
    while num_done < len(tallies):
        envelope = delivered.get(timeout=args.timeout_s)
        if isinstance(envelope.msg, TokenBatch):
            _fold(envelope.msg, tallies)
        elif isinstance(envelope.msg, RequestFinished):
            tallies[envelope.msg.request_id].is_done = True
            num_done += 1
    seconds = time.perf_counter() - start
    stats = engine.stats()
    loop.stop(30.0)
    short = {rid: {"engine_tokens": t.num_engine_tokens, "usage_tokens": t.output.num_completion_tokens,
                   "finish_reason": t.output.samples[0].finish_reason, "engine_finish": t.engine_finish}
             for rid, t in tallies.items()
             if t.num_engine_tokens != args.output_len or t.output.num_completion_tokens != args.output_len}
    result = {
        "kv_cache_dtype": kv_dtype, "num_pages": engine.num_pages, "max_seq_len": engine.max_seq_len,
        "seconds": round(seconds, 2), "num_requests": len(tallies),
        "expected_tokens": args.output_len * len(tallies),
        "engine_tokens": sum(t.num_engine_tokens for t in tallies.values()),
        "usage_tokens": sum(t.output.num_completion_tokens for t in tallies.values()),
        "finish_reasons": dict(Counter(t.output.samples[0].finish_reason for t in tallies.values())),
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
        "graph_replays": engine.graphs.num_replays if engine.graphs is not None else 0,
        "sampled_rows": watch.num_rows, "nonfinite_logit_rows": watch.num_nonfinite_rows,
        "special_argmax_ids": {str(k): v for k, v in watch.special_ids.most_common(20)},
        "num_short": len(short), "short": dict(list(short.items())[:50]),
    }
    del loop, engine, watch
    gc.collect()  # the watched _forward closes over its engine: a cycle
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-dtypes", default="fp8,auto", help="comma-separated: fp8, auto")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="default: sized from memory, as serve does")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--overlap", type=lambda s: s == "on", default=None, help="on/off (default: on for CUDA)")
    p.add_argument("--watch-logits", action="store_true", help="check every sampled row for NaN/inf (syncs)")
    p.add_argument("--stagger-s", type=float, default=0.0, help="pause between request arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="a directory for exact_lengths.json")
    args = p.parse_args()
    results = []
    for kv_dtype in args.kv_cache_dtypes.split(","):
        result = run_dtype(args, kv_dtype)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "short"}), flush=True)
        for rid, row in list(result["short"].items())[:10]:
            print("  short:", rid, row, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "exact_lengths.json").write_text(json.dumps(results, indent=1))
    raise SystemExit(0 if all(r["num_short"] == 0 for r in results) else 1)


if __name__ == "__main__":
    main()
