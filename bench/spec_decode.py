"""Offline: batch-1 TPOT with and without speculative decoding (n-gram prompt lookup) on an edit-a-passage workload.

Each request gives the bundled chat model a passage of code and asks for it back with one small change (a rename), so
most of the answer copies the prompt: the workload prompt lookup is made for. Two engines share the loaded weights,
one plain and one with `speculative_method="ngram"`; rounds alternate which runs first, and each request's TPOT is
(time of its last token - time of its first) / (tokens - 1), so prefill is left out. Reports the median TPOT of
each engine, their ratio, whether the greedy outputs were identical, and the acceptance counters; then the same for
free-form questions, whose answers copy little: the cost of speculation where its drafts mostly fail.

    .venv/bin/python -m bench.spec_decode --threads 1 --out bench/results/spec_decode_cpu_$(date +%Y%m%d).json
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
from services.gpu_worker.model.loader import load_model
from services.gpu_worker.request import SamplingParams
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


def timed_request(engine: Engine, request_id: str, prompt: list[int],
                  params: SamplingParams) -> tuple[list[int], float]:
    """Run one request alone → its output tokens and its TPOT in seconds (first token to last, per token)."""
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    first_s = last_s = 0.0
    while engine.has_unfinished():
        outputs = engine.step() or engine.flush()
        now = time.perf_counter()
        for out in outputs:
            if out.token_ids and not tokens:
                first_s = now
            tokens += out.token_ids
            last_s = now if out.token_ids else last_s
    engine.release_finished(request_id)
    return tokens, (last_s - first_s) / max(len(tokens) - 1, 1)


def compare(engines: dict[str, Engine], batch: list[list[int]], params: SamplingParams, rounds: int,
            label: str) -> dict:
    """Alternating rounds of every prompt on each engine → TPOTs, medians, identity and the acceptance counters."""
    for engine in engines.values():
        engine.metrics = type(engine.metrics)()
    tpot: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, dict[int, list[int]]] = {name: {} for name in engines}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for i, prompt in enumerate(batch):
            for name in order:
                tokens, seconds = timed_request(engines[name], f"{label}{round_index}-{i}", prompt, params)
                tpot[name].append(seconds)
                outputs[name][i] = tokens
        print(f"{label} round {round_index}: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms"
                                                          for n, t in tpot.items()), flush=True)
    medians = {name: statistics.median(times) for name, times in tpot.items()}
    m = engines["ngram"].metrics
    return {
        "num_prompts": len(batch), "prompt_tokens": [len(p) for p in batch],
        "output_tokens": [len(outputs["plain"][i]) for i in range(len(batch))],
        "is_identical": outputs["plain"] == outputs["ngram"],
        "tpot_ms": {name: [round(t * 1e3, 2) for t in times] for name, times in tpot.items()},
        "median_tpot_ms": {name: round(t * 1e3, 2) for name, t in medians.items()},
        "speedup": round(medians["plain"] / medians["ngram"], 3),
        "spec_decode": {"num_drafts": m.num_spec_drafts, "num_draft_tokens": m.num_spec_draft_tokens,
                        "num_accepted_tokens": m.num_spec_accepted_tokens,
                        "acceptance_rate": round(m.num_spec_accepted_tokens / max(m.num_spec_draft_tokens, 1), 3),
                        "mean_accepted_length": round(1 + m.num_spec_accepted_tokens / max(m.num_spec_drafts, 1), 3)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=torch.float32)
    base = dict(model=args.model, device="cpu", dtype="float32")
    engines = {"plain": Engine(EngineConfig(**base), loaded=loaded),
               "ngram": Engine(EngineConfig(**base, speculative_method="ngram", num_speculative_tokens=args.k),
                               loaded=loaded)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    edits = prompts(engines["plain"])
    for engine in engines.values():  # warm-up
        timed_request(engine, "warmup", edits[0], SamplingParams(max_tokens=8, temperature=0.0))
    result = {
        "bench": "spec_decode", "model": args.model, "device": "cpu", "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "k": args.k, "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "edit": compare(engines, edits, params, args.rounds, "edit"),
        # free-form answers copy little: what speculation costs where it mostly fails (adaptive k backs off)
        "free": compare(engines, [chat_prompt_ids(engines["plain"].tokenizer, [{"role": "user", "content": q}])
                                  for q in QUESTIONS], params, args.rounds, "free"),
    }
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "tpot_ms"} if isinstance(v, dict) else v)
                      for k, v in result.items()}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
