"""Service overhead: TTFT and inter-token latency through `radixserve serve` (HTTP, SSE, five processes)
against the offline engine on the same prompts, one request at a time, interleaved prompt by prompt in one run.

    python -m bench.service_overhead --num-prompts 8 --output-len 32
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from bench.engine_offline import _commit, _hardware
from services.gpu_worker.engine import Engine
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.request import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "Explain what a radix tree is.",
             "Write a haiku about the sea.", "What is 17 times 23?", "Give me a tip for learning Python.",
             "Why is the sky blue?", "Summarize the plot of Hamlet in one sentence."]


def time_http(url: str, prompts: list[str], output_len: int) -> list[tuple[float, list[float]]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    runs = []
    for text in prompts:
        start = time.perf_counter()
        stamps = []
        stream = client.completions.create(model="smollm2-135m-instruct", prompt=text, max_tokens=output_len,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter() - start)
        runs.append((stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]))
    return runs


def time_engine(engine: Engine, prompt_ids: list[list[int]], output_len: int) -> list[tuple[float, list[float]]]:
    """Stamps as the HTTP side sees them: when the detokenized text (special tokens skipped) grows, so a first
    token that is a special one (SmolLM2 often starts with <|im_end|>) counts on neither side."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    runs = []
    for i, ids in enumerate(prompt_ids):
        start = time.perf_counter()
        engine.add_request(f"o{i}", ids, params)
        stamps, tokens, text_len = [], [], 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
            now = time.perf_counter() - start
            grown = len(engine.tokenizer.decode(tokens, skip_special_tokens=True))
            if grown > text_len:
                stamps.append(now)
                text_len = grown
        engine.release_finished(f"o{i}")
        runs.append((stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]))
    return runs


def summarize(runs: list[tuple[float, list[float]]]) -> dict:
    itls = [gap for _, gaps in runs for gap in gaps]
    return {"ttft_ms_median": 1000 * statistics.median(t for t, _ in runs),
            "itl_ms_median": 1000 * statistics.median(itls), "itl_ms_mean": 1000 * statistics.mean(itls)}


def start_server(port: int, num_pages: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--device", "cpu",
                             "--num-pages", str(num_pages), "--no-prefix-cache"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not start")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    proc = start_server(args.port, args.num_pages)
    try:
        engine = Engine(EngineConfig(model="bundled", device="cpu", num_pages=args.num_pages,
                                     enable_prefix_cache=False))
        prompts = (QUESTIONS * 4)[: args.num_prompts]
        prompt_ids = [engine.tokenizer.encode(t) for t in prompts]
        url = f"http://127.0.0.1:{args.port}"
        time_engine(engine, prompt_ids[:1], 4)  # warm-up
        time_http(url, prompts[:1], 4)
        offline_runs, http_runs = [], []
        for text, ids in zip(prompts, prompt_ids):  # interleaved, so machine noise hits both alike
            offline_runs += time_engine(engine, [ids], args.output_len)
            http_runs += time_http(url, [text], args.output_len)
        offline, http = summarize(offline_runs), summarize(http_runs)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    figures = {"offline_engine": offline, "http_service": http,
               "ttft_overhead_ms": http["ttft_ms_median"] - offline["ttft_ms_median"],
               "itl_overhead_ms": http["itl_ms_median"] - offline["itl_ms_median"]}
    record = {"command": "python -m bench.service_overhead " + " ".join(argv or sys.argv[1:]), "commit": _commit(),
              "hardware": _hardware("cpu"), "date": time.strftime("%Y-%m-%d"), "workload": "service-overhead",
              "settings": vars(args), "figures": figures}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"service_overhead_cpu_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    print(json.dumps(figures, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
