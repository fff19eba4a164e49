"""The `radixserve` command: `serve` the suite, `generate` offline on the engine, `quantize` a model into a published
quantized checkpoint, or `bench` a server."""
from __future__ import annotations

import argparse
import sys
import time

from services.gpu_worker.request import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the whole suite on this machine (gateway, tokenizer, "
                                         "scheduler, cache_index, gpu_worker, Redis)")
    from radixserve.serve import add_serve_arguments
    add_serve_arguments(serve)
    gen = sub.add_parser("generate", help="generate text offline with the engine (no services)")
    gen.add_argument("prompt", help="the user message (or raw prompt with --raw)")
    gen.add_argument("--model", default="bundled",
                     help='"bundled" (SmolLM2-135M-Instruct), a Hugging Face directory, or random:<preset>')
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    quantize = sub.add_parser(
        "quantize", help="write a model's quantized weights once as a published checkpoint (compressed-tensors FP8, "
                         "AutoAWQ, GPTQ v1); `serve --model OUT` then loads it as it is",
        description="Quantize a model's decoder linear layers and write a Hugging Face directory: config.json with "
                    "its quantization_config, model.safetensors (the quantized layers, the rest dense) and the "
                    "tokenizer. Calibrated methods run the model over built-in text (stdlib docstrings) on this "
                    "machine's CPU: GPTQ FP8 of the bundled model takes about 2 minutes on 2 cores.")
    quantize.add_argument("--model", required=True,
                          help='"bundled" (SmolLM2-135M-Instruct, from its GGUF), a dense Hugging Face directory, or '
                               "random:<preset>")
    quantize.add_argument("--method", required=True, choices=["fp8", "awq", "gptq"],
                          help="fp8: e4m3 per channel, activations per token (compressed-tensors); awq: INT4, AutoAWQ "
                               "GEMM layout; gptq: INT4, GPTQ v1 layout")
    quantize.add_argument("--out", required=True, help="the directory to write (new or empty)")
    quantize.add_argument("--calibration", choices=["gptq", "awq", "rtn"], default=None,
                          help="how the weights are chosen: fp8 gptq (default) or rtn; awq awq (activation-aware "
                               "scales, each group's scale and zero searched, GPTQ rounding on them; default, about "
                               "3 minutes for the bundled model on one core) or rtn; gptq gptq (act-order, default) "
                               "or rtn. rtn: round to nearest, seconds, no calibration text")
    quantize.add_argument("--calibration-tokens", type=int, default=None,
                          help="calibration text tokens, in windows of up to 512 (default 2048 for --method awq, "
                               "whose INT4 grid search meets +10 %% perplexity on the bundled model from there; 1024 "
                               "otherwise)")
    quantize.add_argument("--group-size", type=int, default=128,
                          help="INT4 group size asked for; its gcd with every layer's input size is used")
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (workloads W0-W6, a trace); "
                                         "the engine without HTTP: python -m bench.engine_offline")
    from radixserve.bench.main import add_bench_arguments
    add_bench_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench":
        from radixserve.bench.main import run_bench
        return run_bench(args, argv[1:] if argv is not None else sys.argv[2:])
    if args.command == "quantize":
        return _quantize(args)
    if args.command == "serve":
        from radixserve.serve import run_serve
        return run_serve(args)
    return 2


def _generate(args: argparse.Namespace) -> int:
    from services.gpu_worker.engine import Engine
    from services.gpu_worker.engine_config import EngineConfig

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    print(f"loaded in {time.perf_counter() - started:.1f}s on {engine.device}", file=sys.stderr, flush=True)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        print("error: this model has no tokenizer; use a Hugging Face directory or the bundled model",
              file=sys.stderr)
        return 2
    prompt_ids = _encode(tokenizer, args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    engine.add_request("cli", prompt_ids, params)
    output_ids: list[int] = []
    printed = ""
    while engine.has_unfinished():
        for out in engine.step():
            output_ids.extend(out.token_ids)
        text = tokenizer.decode(output_ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # never print half a UTF-8 character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from services.gpu_worker.quant.writer import quantize_checkpoint

    try:
        quantize_checkpoint(args.model, args.method, args.out, args.calibration, args.calibration_tokens,
                            args.group_size, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _encode(tokenizer, args: argparse.Namespace) -> list[int]:
    if args.raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(args.prompt)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
