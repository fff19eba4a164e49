"""Offline: the per-step cost of structured output on the engine. At each batch size, B requests decode with no
constraint, then the same B under each of two JSON schemas (a list of at least 100 {name, qty} items, so no row's
grammar completes within the timed steps); the time of --steps decode steps run back to back, as the serving loop
runs them, is compared (and, as a step's latency alone, --steps more each between two device syncs). The
constrained run pays the bitmask fill (CPU), its copy and the mask on the device, and in overlap mode the early read
of the previous step (Engine._constrain). Runs unchanged on CUDA (overlap and CUDA graphs as configured by default).
The default warm-up (40 steps) leaves the grammar's lazily built lexer warm, as in a server that has answered the
schema for a while; a small --warmup times its cold start instead.

    .venv/bin/python -m bench.structured_output --device cpu --out bench/results/structured_output_cpu.json
    .venv/bin/python -m bench.structured_output --device cuda --out bench/results/structured_output_h200.json
    .venv/bin/python -m bench.structured_output --device cuda --model random:llama3-8b --tokenizer DIR

A random:* model has no tokenizer: --tokenizer DIR (a Hugging Face tokenizer directory, e.g. the bundled model's
cache directory) lends it one, so the grammar runs against real token strings while the step and the bitmask have
the model's own shape (Llama-3.1-8B: 128,256 rows of mask, ids past the tokenizer's vocabulary always masked).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.structured_output import StructuredOutput
from shared.output_constraint import ConstraintKind, OutputConstraint

def _schema(max_name_len: int | None) -> dict:
    name: dict = {"type": "string"} if max_name_len is None else {"type": "string", "maxLength": max_name_len}
    return {"type": "array", "minItems": 100, "items": {
        "type": "object", "properties": {"name": name, "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "qty"], "additionalProperties": False}}


# Two schemas: strings as a plain Pydantic model has them, and bounded (maxLength, Pydantic's constr(max_length=16)).
# A bounded string defeats llguidance's slicer (its precomputed token sets for free string content), so each row's
# mask walks the whole token trie: ~8x the CPU time a row (docs/PERFORMANCE.md)
SCHEMAS = {"open_strings": _schema(None), "bounded_strings": _schema(16)}
CONSTRAINTS = {name: OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
               for name, schema in SCHEMAS.items()}


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def step_times(engine: Engine, batch: int, constraint: OutputConstraint | None, num_steps: int,
               num_warmup: int) -> dict[str, float]:
    """Milliseconds a decode step of `batch` live rows costs: `mean_ms`, num_steps steps run back to back as the
    serving loop runs them (one sync before, one after: in overlap mode each step's host work, the bitmask fill
    included, runs while the device computes), then `synced_mean_ms` / `synced_median_ms`, num_steps more each
    between two syncs (a step's latency alone: its host work and its device work one after the other)."""
    prompts = [engine.tokenizer.encode(f"List {i + 3} groceries with quantities as JSON.") for i in range(batch)]
    params = SamplingParams(max_tokens=num_warmup + 2 * num_steps + 8, temperature=0.0, ignore_eos=True,
                            output_constraint=constraint)
    ids = [f"{'c' if constraint else 'f'}{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    for _ in range(num_warmup):  # prefill, and the first decodes (CUDA graphs, grammar caches warm)
        engine.step()
    _sync(engine)
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    _sync(engine)
    back_to_back = (time.perf_counter() - start) / num_steps
    times = []
    for _ in range(num_steps):
        _sync(engine)
        start = time.perf_counter()
        engine.step()
        _sync(engine)
        times.append(time.perf_counter() - start)
    num_live = sum(not seq.is_finished for rid in ids for seq in engine._requests[rid])
    for request_id in ids:
        engine.abort(request_id)
    engine.flush()
    return {"mean_ms": round(back_to_back * 1e3, 3), "synced_mean_ms": round(statistics.mean(times) * 1e3, 3),
            "synced_median_ms": round(statistics.median(times) * 1e3, 3), "num_live_rows_at_end": num_live}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=40,
                        help="decode steps before timing: llguidance builds its lexer's states lazily (shared by the "
                             "copies of one compiled grammar), so a server that has answered a schema for a while "
                             "runs it warm; --warmup 5 times the cold start (the H100's bounded schema at batch 64: "
                             "+28.8 %% back to back after 5, its synced median +4.7 %%)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a Hugging Face tokenizer directory lent to a model without one (random:*)")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device=args.device, max_num_seqs=max(args.batches),
                          enable_prefix_cache=False)
    engine = Engine(config)
    if args.tokenizer is not None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        engine.runner.tokenizer = tokenizer  # the grammar's end is the lent tokenizer's EOS, not the model's ids
        engine.structured = StructuredOutput(tokenizer, engine.model_config.vocab_size, [tokenizer.eos_token_id],
                                             engine.device)
    report = {"device": args.device, "model": args.model, "tokenizer": str(args.tokenizer) if args.tokenizer else None,
              "host": platform.node(), "cpus": os.cpu_count(),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "overlap": engine.is_overlapped, "cuda_graphs": engine.graphs is not None, "steps": args.steps,
              "schemas": SCHEMAS, "batches": {}}
    for batch in args.batches:
        free = step_times(engine, batch, None, args.steps, args.warmup)
        row: dict = {"free": free, "constrained": {}, "overhead_pct": {}}
        for name, constraint in CONSTRAINTS.items():
            constrained = step_times(engine, batch, constraint, args.steps, args.warmup)
            overhead = constrained["mean_ms"] / free["mean_ms"] - 1
            synced = constrained["synced_mean_ms"] / free["synced_mean_ms"] - 1
            row["constrained"][name] = constrained
            row["overhead_pct"][name] = round(100 * overhead, 1)
            row.setdefault("synced_overhead_pct", {})[name] = round(100 * synced, 1)
            print(f"batch {batch}: free {free['mean_ms']} ms, {name} {constrained['mean_ms']} ms "
                  f"({100 * overhead:+.1f} %; a step alone {100 * synced:+.1f} %)", flush=True)
        report["batches"][str(batch)] = row
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
