"""Offline: TPOT with and without speculative decoding, on prompt lookup (n-gram) or a replay proposer.

N-gram mode (the default; CPU, bundled model): each request gives the bundled chat model a passage of code and asks
for it back with one small change (a rename), so most of the answer copies the prompt: the workload prompt lookup is
made for. Two engines share the loaded weights, one plain and one with `speculative_method="ngram"`; rounds
alternate which runs first, and each request's TPOT is (time of its last token - time of its first) / (tokens - 1),
so prefill is left out. Reports the median TPOT of each engine, their ratio, whether the greedy outputs were
identical, and the acceptance counters; then the same for free-form questions, whose answers copy little: the cost
of speculation where its drafts mostly fail.

    .venv/bin/python -m bench.spec_decode --threads 1 --out bench/results/spec_decode_cpu_$(date +%Y%m%d).json

Replay mode (`--proposer replay`; any device, random weights of a real shape): per batch size B of --batches
(default: --num-prompts), the plain engine first decodes B random token-id prompts together, greedily (EOS ignored),
and its outputs are recorded; then, per --alpha, the speculating engine's proposer (spec/replay.py) proposes each
sequence's recorded continuation from its current position, each draft the true token with probability alpha, so a
draft is accepted with probability alpha given the ones before it were. Per batch and alpha: the median TPOT of plain
and speculative decoding (alternating rounds, same prompts, the B requests decoded together), their ratio, the
acceptance counters, the tokens a verified row appends (measured mean accepted length beside the analytic
(1 - alpha^(k+1)) / (1 - alpha)), how many verify steps replayed a CUDA graph, and whether the outputs equal the
recorded ones. Both engines are warmed up first (CUDA graphs are captured at engine start; Triton compiles each eager
shape on first use), and on CUDA each batch starts and ends on a synchronized device.

    .venv/bin/python -m bench.spec_decode --device cuda --model random:llama3-8b --proposer replay \\
        --alpha 0.8 0 --k 4 --batches 1 8 64 --out bench/results/spec_decode_h200_$(date +%Y%m%d).json
    .venv/bin/python -m bench.spec_decode --device cpu --model random:tiny-llama --proposer replay \\
        --alpha 0.8 0 --k 4 --rounds 1 --batches 1 2

On CUDA a step with drafts whose rows are all decodes (drafted or not) replays a verify graph
(cuda_graphs.VerifyGraphs: k + 1 query tokens a row, short rows padded), so a drafted step costs a replay, not an
eager step's host launches; it is still read at once, not overlapped. Steps in which nothing is drafted replay the
decode graphs and overlap as a plain engine's.

In bf16 a verify row's logits differ in rounding from the plain step's, so at a near-tie the speculative output may
leave the recorded one (random weights make near-ties common); from there the replay proposer has no continuation
and proposes nothing. The report gives each output's common prefix with the record and the TPOT over that prefix.
So replay mode first scales the random model's residual branches down (--residual-scale, default 1e-3) and ties its
LM head to the embedding (make_greedy_robust): each step costs what it did, and the greedy output (the last prompt
token, repeated) has no near-tie to flip.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams
from services.gpu_worker.spec.replay import ReplayProposer
from services.tokenizer.chat_prompt import chat_prompt_ids

SYSTEM = "You are a code editor. You output the edited code only, copying every unchanged line exactly."
PASSAGES = [
    ('''class LruCache:
    """A mapping that keeps at most capacity entries, dropping the least recently used one."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._entries = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key, default=None):
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key, value) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
        self._entries[key] = value
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
''', "Rename the class LruCache to RecentCache. Output the full code."),
    ('''def merge_intervals(intervals):
    """Merge overlapping intervals given as (start, end) pairs."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_length(intervals):
    """The total length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))
''', "Rename the function merge_intervals to merge_ranges everywhere. Output the full code."),
    ('''import json
from pathlib import Path


def load_settings(path: Path) -> dict:
    """Read a JSON settings file; a missing file gives the defaults."""
    defaults = {"host": "127.0.0.1", "port": 8000, "workers": 1, "log_level": "info"}
    if not path.exists():
        return defaults
    with path.open() as f:
        settings = json.load(f)
    for key, value in defaults.items():
        settings.setdefault(key, value)
    return settings


def save_settings(path: Path, settings: dict) -> None:
    """Write the settings as indented JSON."""
    with path.open("w") as f:
        json.dump(settings, f, indent=2, sort_keys=True)
''', "Change the default port from 8000 to 9000. Output the full code."),
]

QUESTIONS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how vaccines train the immune system, for a ten-year-old.",
             "Give me five ideas for a rainy weekend with children, with a sentence on each."]


def prompts(engine: Engine) -> list[list[int]]:
    return [chat_prompt_ids(engine.tokenizer, [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"```python\n{code}```\n\n{ask}"}])
            for code, ask in PASSAGES]


CUDA_NUM_PAGES = 512  # 8,192 tokens a pool at least: batch 1 needs 128 + 256 (larger batches get more)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def timed_request(engine: Engine, request_id: str, prompt: list[int],
                  params: SamplingParams) -> tuple[list[int], list[float]]:
    """Run one request alone → its output tokens and the time each reached the host (perf_counter seconds)."""
    return timed_batch(engine, request_id, [prompt], params)[0]


def timed_batch(engine: Engine, label: str, batch: list[list[int]],
                params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    """Run these prompts together (added at once, decoded in the same steps) → per prompt its output tokens and the
    time each reached the host (perf_counter seconds)."""
    _sync(engine)  # the previous requests' device work is not these ones'
    ids = [label if len(batch) == 1 else f"{label}-{i}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    stamps: dict[str, list[float]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        outputs = engine.step() or engine.flush()
        now = time.perf_counter()  # the step's tokens were read to the host: its device work is done
        for out in outputs:
            tokens[out.request_id] += out.token_ids
            stamps[out.request_id] += [now] * len(out.token_ids)
    _sync(engine)
    for request_id in ids:
        engine.release_finished(request_id)
    return [(tokens[request_id], stamps[request_id]) for request_id in ids]


def tpot(stamps: list[float], num_tokens: int | None = None) -> float:
    """Seconds per token from the first token to token num_tokens (default: the last): prefill left out."""
    n = len(stamps) if num_tokens is None else num_tokens
    return (stamps[n - 1] - stamps[0]) / max(n - 1, 1)


def _counters(engine: Engine) -> dict:
    m = engine.metrics
    return {"num_drafts": m.num_spec_drafts, "num_draft_tokens": m.num_spec_draft_tokens,
            "num_accepted_tokens": m.num_spec_accepted_tokens,
            "acceptance_rate": round(m.num_spec_accepted_tokens / max(m.num_spec_draft_tokens, 1), 3),
            "mean_accepted_length": round(1 + m.num_spec_accepted_tokens / max(m.num_spec_drafts, 1), 3)}


def _rounds(engines: dict[str, Engine], batch: list[list[int]], params: SamplingParams, rounds: int,
            label: str, together: bool = False) -> tuple[dict[str, list[list[float]]], dict[str, dict[int, list[int]]]]:
    """Alternating rounds of every prompt on each engine (metrics reset first), one request at a time or, together,
    all of them at once → per engine the token stamps of every request run, and the last output of each prompt."""
    for engine in engines.values():
        engine.metrics = type(engine.metrics)()
    stamps: dict[str, list[list[float]]] = {name: [] for name in engines}
    outputs: dict[str, dict[int, list[int]]] = {name: {} for name in engines}
    groups = [list(range(len(batch)))] if together else [[i] for i in range(len(batch))]
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for group in groups:
            for name in order:
                runs = timed_batch(engines[name], f"{label}{round_index}-{group[0]}", [batch[i] for i in group], params)
                for i, (tokens, times) in zip(group, runs):
                    stamps[name].append(times)
                    outputs[name][i] = tokens
        print(f"{label} round {round_index}: " + ", ".join(
            f"{n} {statistics.median(tpot(t) for t in runs) * 1e3:.2f} ms" for n, runs in stamps.items()), flush=True)
    return stamps, outputs


def compare(engines: dict[str, Engine], batch: list[list[int]], params: SamplingParams, rounds: int,
            label: str) -> dict:
    """N-gram mode: TPOTs of both engines, medians, identity and the acceptance counters."""
    stamps, outputs = _rounds(engines, batch, params, rounds, label)
    times = {name: [tpot(t) for t in runs] for name, runs in stamps.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "num_prompts": len(batch), "prompt_tokens": [len(p) for p in batch],
        "output_tokens": [len(outputs["plain"][i]) for i in range(len(batch))],
        "is_identical": outputs["plain"] == outputs["ngram"],
        "tpot_ms": {name: [round(t * 1e3, 2) for t in ts] for name, ts in times.items()},
        "median_tpot_ms": {name: round(t * 1e3, 2) for name, t in medians.items()},
        "speedup": round(medians["plain"] / medians["ngram"], 3),
        "spec_decode": _counters(engines["ngram"]),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def expected_tokens_per_verify(alpha: float, k: int) -> float:
    """Tokens a verified row of k drafts appends when each draft is accepted with probability alpha given the ones
    before it were: the accepted drafts plus the target's own token, sum of alpha^j for j = 0..k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def replay_alpha(engines: dict[str, Engine], batch: list[list[int]], recorded: list[list[int]],
                 params: SamplingParams, alpha: float, rounds: int, seed: int) -> dict:
    """Replay mode at one alpha, the batch's prompts decoded together: plain against speculative TPOT, the acceptance
    counters beside their analytic expectation, the verify graphs' replays, identity to the record."""
    spec = engines["spec"]
    proposer = ReplayProposer({tuple(p): out for p, out in zip(batch, recorded)}, alpha,
                              spec.model_config.vocab_size, seed)
    spec.speculator.proposer = proposer
    replays_before = spec.verify_graphs.num_replays if spec.verify_graphs is not None else 0
    stamps, outputs = _rounds(engines, batch, params, rounds, f"b{len(batch)}-a{alpha}-", together=True)
    counters = _counters(spec)
    times = {name: [tpot(t) for t in runs] for name, runs in stamps.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    common = [_common_prefix(outputs["spec"][i], recorded[i]) for i in range(len(batch))]
    # over each run's tokens up to its prompt's common prefix with the record (the whole output when identical)
    prefix_tpot = [tpot(t, max(min(common[i % len(batch)], len(t)), 1)) for i, t in enumerate(stamps["spec"])]
    return {
        "alpha": alpha, "output_tokens": [len(outputs["spec"][i]) for i in range(len(batch))],
        "is_identical": all(outputs["spec"][i] == recorded[i] for i in range(len(batch))),
        "is_plain_identical": all(outputs["plain"][i] == recorded[i] for i in range(len(batch))),
        "common_prefix_tokens": common,
        "tpot_ms": {name: [round(t * 1e3, 3) for t in ts] for name, ts in times.items()},
        "median_tpot_ms": {name: round(t * 1e3, 3) for name, t in medians.items()},
        "tpot_ratio": round(medians["spec"] / medians["plain"], 3),
        "median_spec_tpot_common_prefix_ms": round(statistics.median(prefix_tpot) * 1e3, 3),
        "spec_decode": counters,
        # NOTE: the analytic value assumes k drafts a row; adaptive k (spec/adaptive.py) and max_tokens give fewer
        "tokens_per_verify": {"expected": round(expected_tokens_per_verify(alpha, spec.config.num_speculative_tokens),
                                                3),
                              "measured": counters["mean_accepted_length"]},
        "verify_graph_replays": (None if spec.verify_graphs is None
                                 else spec.verify_graphs.num_replays - replays_before),
        "replay": {"num_draft_tokens_proposed": proposer.num_proposed,
                   "true_draft_rate": round(proposer.num_true / max(proposer.num_proposed, 1), 3),
                   "num_diverged_proposals": proposer.num_diverged},
    }


def random_prompts(num: int, num_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(num_tokens)] for _ in range(num)]


def run_replay(args: argparse.Namespace, engines: dict[str, Engine]) -> dict:
    """Per batch size: record the plain engine's greedy outputs of that many prompts decoded together (its warm-up),
    warm the speculative engine up on them, then each alpha. The batches' prompts are the first of one list."""
    plain, spec = engines["plain"], engines["spec"]
    prompts = random_prompts(max(args.batches), args.prompt_tokens, plain.model_config.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    by_batch = {}
    for size in args.batches:
        batch = prompts[:size]
        # NOTE: recorded per batch size: a bf16 near-tie may decode differently in another batch's GEMM shapes
        recorded = [tokens for tokens, _ in timed_batch(plain, f"record{size}", batch, params)]
        warmup = ReplayProposer({tuple(p): out for p, out in zip(batch, recorded)}, 0.5, plain.model_config.vocab_size,
                                args.seed)
        spec.speculator.proposer = warmup  # partial acceptance: drafted rows of every length up to k, then plain steps
        timed_batch(spec, f"warmup{size}", batch, params)
        by_batch[str(size)] = {
            "num_prompts": size,
            "alphas": {str(alpha): replay_alpha(engines, batch, recorded, params, alpha, args.rounds, args.seed)
                       for alpha in args.alpha}}
    return {"prompt_tokens": args.prompt_tokens, "batches": by_batch,
            "verify_graph_buckets": None if spec.verify_graphs is None else spec.verify_graphs.buckets}


def run_ngram(args: argparse.Namespace, engines: dict[str, Engine]) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    edits = prompts(engines["plain"])
    for engine in engines.values():  # warm-up
        timed_request(engine, "warmup", edits[0], SamplingParams(max_tokens=8, temperature=0.0))
    return {
        "edit": compare(engines, edits, params, args.rounds, "edit"),
        # free-form answers copy little: what speculation costs where it mostly fails (adaptive k backs off)
        "free": compare(engines, [chat_prompt_ids(engines["plain"].tokenizer, [{"role": "user", "content": q}])
                                  for q in QUESTIONS], params, args.rounds, "free"),
    }


def make_greedy_robust(state_dict: dict[str, torch.Tensor], residual_scale: float) -> None:
    """Replay mode's random weights, in place: every layer's residual-branch output projections (o_proj, down_proj)
    times `residual_scale`, and the LM head set to the input embedding.

    Why: a random model's greedy choices are near-ties everywhere, so the bf16 rounding by which a verify row (k + 1
    tokens, the extend kernel) differs from a plain decode step (one token, the decode kernel and the GEMV) flips one
    within a few tokens, and the output leaves its record (an H100 run: after 1 to 19 tokens; with the branches
    scaled by 1e-3 alone, after 2 to 27). With both, the last hidden state is about the current token's embedding and
    the LM head scores that token ~sqrt(hidden) times above the rest: the greedy output repeats the last prompt token,
    with no near-tie to flip. Shapes, bytes and FLOPs are unchanged, so every step costs what it did."""
    for name, weight in state_dict.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weight.mul_(residual_scale)
    if "lm_head.weight" in state_dict:
        state_dict["lm_head.weight"].copy_(state_dict["model.embed_tokens.weight"])


def build_engines(args: argparse.Namespace) -> dict[str, Engine]:
    """A plain engine and a speculating one (n-gram proposer; replay mode swaps it) on the same loaded weights, each
    running the largest batch at once (and speculating in it)."""
    largest = max(args.batches) if args.proposer == "replay" else 1
    base: dict = dict(model=args.model, device=args.device, num_pages=args.num_pages)
    if args.device == "cpu":
        base["dtype"] = "float32"
    else:  # a small KV pool: two engines share the GPU, each sized from free memory would take it all
        per_seq = -(-(args.prompt_tokens + (args.max_tokens or 0) + args.k + 1) // EngineConfig.page_size) + 1
        base.update(num_pages=args.num_pages or max(CUDA_NUM_PAGES, largest * per_seq + 1),
                    max_num_seqs=max(8, largest))
    config = EngineConfig(**base)
    loaded = load_model(args.model, dtype=config.resolved_dtype(), device=config.resolved_device())
    if args.proposer == "replay" and args.residual_scale != 1.0:  # 1: as loaded, the LM head untouched too
        make_greedy_robust(loaded.state_dict, args.residual_scale)
    spec_name = "ngram" if args.proposer == "ngram" else "spec"
    engines = {"plain": Engine(config, loaded=loaded),
               spec_name: Engine(EngineConfig(**base, speculative_method="ngram", num_speculative_tokens=args.k,
                                              speculative_max_batch_size=max(largest, 1)),
                                 loaded=loaded)}
    loaded.state_dict.clear()  # each engine holds its own copy of the weights
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return engines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proposer", choices=("ngram", "replay"), default="ngram")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--residual-scale", type=float, default=1e-3,
                        help="replay: scale of the layers' o_proj and down_proj weights, the LM head then tied to the "
                        "embedding (make_greedy_robust), so random weights' greedy output survives bf16 rounding "
                        "differences; 1: the weights as loaded")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens (default: 160 n-gram, 256 replay)")
    parser.add_argument("--rounds", type=int, default=None, help="default: 5 n-gram, 2 replay")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.8, 0.0],
                        help="replay: the probability that a draft is the true token, one run each")
    parser.add_argument("--num-prompts", type=int, default=4, help="replay: random token-id prompts")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="replay: batch sizes, each that many prompts decoded together (default: --num-prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="replay: tokens per prompt")
    parser.add_argument("--num-pages", type=int, default=None,
                        help=f"KV pages per engine (default: {CUDA_NUM_PAGES} on cuda, the engine's own on the cpu)")
    parser.add_argument("--seed", type=int, default=0, help="replay: the prompts' and the drafts' seed")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    is_replay = args.proposer == "replay"
    if args.max_tokens is None:
        args.max_tokens = 256 if is_replay else 160
    if args.rounds is None:
        args.rounds = 2 if is_replay else 5
    if args.batches is None:
        args.batches = [args.num_prompts]
    if min(args.batches) < 1:
        parser.error("--batches must be >= 1")
    return args


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _without_tpot_lists(value):
    """The report for the terminal: every per-request TPOT list left out (the --out file keeps them)."""
    if isinstance(value, dict):
        return {k: _without_tpot_lists(v) for k, v in value.items() if k != "tpot_ms"}
    return value


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = build_engines(args)
    result = {
        "bench": "spec_decode", "command": "python -m bench.spec_decode " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "commit": _commit(), "date": time.strftime("%Y-%m-%d"), "proposer": args.proposer, "model": args.model,
        "residual_scale": args.residual_scale if args.proposer == "replay" else None,
        "device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "platform": platform.platform(), "k": args.k, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "overlap": engines["plain"].is_overlapped, "cuda_graphs": engines["plain"].graphs is not None,
    }
    result |= run_replay(args, engines) if args.proposer == "replay" else run_ngram(args, engines)
    print(json.dumps(_without_tpot_lists(result), indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
