"""By hand: llguidance against xgrammar on the bundled SmolLM2 tokenizer (49,152 tokens), on the CPU: tokenizer setup,
compile time of a JSON schema, and the per-step bitmask fill at batch 1 and 64 while each matcher walks a valid
answer token by token. Measures whichever of the two is importable (xgrammar is not a dependency: install it in a
scratch venv to compare).

    .venv/bin/python -m bench.grammar_engines [--out bench/results/grammar_engines_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path


from services.tokenizer.model_files import load_bundled_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "status", "score"],
    "additionalProperties": False,
}
ANSWER = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"], '
          '"address": {"street": "12 St James Square", "city": "London", "zip": "SW1Y 4JH"}, '
          '"status": "active", "score": 9.5}')


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _walk(fill: Callable[[], None], accept: Callable[[int, int], None], reset: Callable[[int], None],
          tokens: list[int], batch: int, is_staggered: bool) -> list[float]:
    """Seconds of each step's fill over the whole batch, then each matcher takes its next token of the answer.

    Staggered: row i starts 7·i tokens into the answer (rows at different places, as in a continuous batch) and
    starts over at the end; otherwise every row walks the answer in step."""
    offsets = [(7 * i) % len(tokens) if is_staggered else 0 for i in range(batch)]
    for row, offset in enumerate(offsets):
        for token in tokens[:offset]:
            accept(row, token)
    times = []
    for _ in range(len(tokens)):
        _, seconds = _timed(fill)
        times.append(seconds)
        for row, offset in enumerate(offsets):
            accept(row, tokens[offset])
            offsets[row] = (offset + 1) % len(tokens)
            if offsets[row] == 0:
                reset(row)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {"mean_us": round(statistics.mean(times) * 1e6, 1), "median_us": round(statistics.median(times) * 1e6, 1),
            "max_us": round(max(times) * 1e6, 1)}


def bench_llguidance(tokenizer, tokens: list[int], batches: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    lltok, setup_s = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    _, compile_s = _timed(lambda: llguidance.LLMatcher(lltok, grammar))
    executor = llguidance.LLExecutor()
    result = {"version": _version("llguidance"), "tokenizer_setup_s": round(setup_s, 3),
              "schema_compile_ms": round(compile_s * 1e3, 2), "fill": {}}
    for batch in batches:
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        bitmask = llguidance.numpy.allocate_token_bitmask(batch, lltok.vocab_size)
        pairs = [(m, i) for i, m in enumerate(matchers)]

        def fill() -> None:
            llguidance.numpy.fill_next_token_bitmask_par(executor, pairs, bitmask)

        def accept(row: int, token: int) -> None:
            assert matchers[row].consume_token(token), matchers[row].get_error()

        result["fill"].update(_fills(matchers, fill, accept, tokens))
    return result


def bench_xgrammar(tokenizer, tokens: list[int], batches: list[int]) -> dict:
    import xgrammar

    info, setup_s = _timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compiled, compile_s = _timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    result = {"version": _version("xgrammar"), "tokenizer_setup_s": round(setup_s, 3),
              "schema_compile_ms": round(compile_s * 1e3, 2), "fill": {}}
    batcher = xgrammar.BatchGrammarMatcher()
    for batch in batches:
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgrammar.allocate_token_bitmask(batch, info.vocab_size)

        def fill() -> None:
            if batch == 1:
                matchers[0].fill_next_token_bitmask(bitmask, 0)
            else:
                batcher.batch_fill_next_token_bitmask(matchers, bitmask)

        def accept(row: int, token: int) -> None:
            assert matchers[row].accept_token(token)

        result["fill"].update(_fills(matchers, fill, accept, tokens))
    return result


def _fills(matchers: list, fill: Callable[[], None], accept: Callable[[int, int], None],
           tokens: list[int]) -> dict[str, dict[str, float]]:
    """Fill times of the batch walking in step, and staggered (batch > 1), keyed batch_B[_staggered]."""
    batch, fills = len(matchers), {}
    for is_staggered in (False, True) if len(matchers) > 1 else (False,):
        for m in matchers:
            m.reset()
        key = f"batch_{batch}" + ("_staggered" if is_staggered else "")
        fills[key] = _summary(_walk(fill, accept, lambda row: matchers[row].reset(), tokens, batch, is_staggered))
    return fills


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tokenizer = load_bundled_tokenizer()
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False)
    report: dict = {"tokenizer_vocab": len(tokenizer), "answer_tokens": len(tokens), "schema": SCHEMA}
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            report[name] = bench(tokenizer, tokens, args.batches)
        except ImportError as exc:
            report[name] = {"skipped": str(exc)}
        print(name, json.dumps(report[name]))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
