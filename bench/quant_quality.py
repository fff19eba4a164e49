"""Quality of the quantized weights (issue 25) on the bundled SmolLM2-135M, CPU: perplexity, teacher-forced top-1
agreement and KL divergence against the float32 model, for FP8 W8A8 and INT4 W4A16.

The text is the docstrings of Python standard library modules (deterministic for one Python version, English prose
with code in it), tokenized and cut into windows that are scored independently; every variant reads the same
windows. INT4 appears twice: round-to-nearest with the scales kept in float32, and the same weights written to the
AutoAWQ checkpoint layout and read back (fp16 scales), which is what a served AWQ-layout model computes. GPTQ
(quant/gptq.py, sequential layer by layer, with and without act-order) is calibrated on --calibration-tokens tokens of
the docstrings of CALIBRATION_MODULES, other stdlib modules than the scored ones, in windows of --window. The GGUF
variant is what `serve --quantization gguf` runs: the bundled file's own Q4_1 blocks as INT4 layers.

Caveat: the bundled weights were themselves dequantized from a Q4_1 GGUF (4-bit, blocks of 32), so INT4 here
re-quantizes weights that already sit on a 4-bit grid of finer blocks; on a bf16 checkpoint the INT4 loss can differ.
For the same reason the GGUF variant's weights are exactly the float32 model's (its blocks dequantized): ~0 % by
construction, not a measure of Q4_1 against a float original.

    python -m bench.quant_quality --out bench/results/quant_quality_cpu.json
    python -m bench.quant_quality --variants int4_gptq int4_gguf --merge --out ...   # re-run some, keep the rest
    python -m bench.quant_quality --variants fp8_gptq_checkpoint --checkpoint DIR --merge --out ...   # a written one
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.model.loader import LoadedModel, bundled_gguf_path, load_bundled, load_hf_dir
from services.gpu_worker.model.registry import architecture_for_type
from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.awq import scale_activation_aware_
from services.gpu_worker.quant.calibration import (CALIBRATION_MODULES, ON_LOAD_CALIBRATION_TOKENS, calibration_windows,
                                                   stdlib_docstrings)
from services.gpu_worker.quant.checkpoint import install_
from services.gpu_worker.quant.fp8 import dequantize_fp8, quantize_weight_fp8
from services.gpu_worker.quant.gguf_int4 import gguf_int4_linears
from services.gpu_worker.quant.gptq import calibrate_gptq_
from services.gpu_worker.quant.int4 import from_awq, to_awq
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.quant.quality import perplexity, sequence_logits, top1_agreement
from services.gpu_worker.quant.writer import checkpoint_group_size, quantize_for_checkpoint_

VARIANTS = {
    "fp8": "FP8 W8A8: e4m3 weights per channel rounded to nearest, activations per token (quant/fp8.py)",
    "fp8_weights_only": "diagnostic: FP8-rounded weights, float32 activations",
    "fp8_gptq": "fp8's format, each e4m3 weight chosen by GPTQ's error feedback, act-order, layer by layer "
                "(quant/gptq.py gptq_quantize_fp8), calibrated; not yet what `serve --quantization fp8` loads (RTN)",
    "int4_rtn": "INT4 W4A16 round-to-nearest, asymmetric, groups of --group-size (gcd with K), float32 scales",
    "int4_awq_layout": "int4_rtn written to the AutoAWQ GEMM layout and read back (fp16 scales)",
    "int4_awq": "activation-aware input-channel scales (quant/awq.py) folded in, then int4_rtn, calibrated, through "
                "the AutoAWQ layout (fp16 scales): what `serve --quantization awq|gptq` loads",
    "int4_awq_gptq": "activation-aware scales folded in, then int4_gptq_act_order",
    "int4_rtn_g32": "diagnostic: int4_rtn with groups of 32",
    "int4_awq_clip": "what `radixserve quantize --method awq` writes (quant/writer.py quantize_for_checkpoint_): AWQ "
                     "scales searched through the shrunk Gram matrix, then each group's INT4 grid by quant/clip.py "
                     "search_grid (each end of its range clipped by a searched ratio, then its scale times 0.86-1.14 "
                     "and its zero point -1/0/+1 by output error), in one group size for every layer (--group-size's "
                     "gcd with every K), fp16 scales, in memory",
    "int4_awq_clip_calib2": "int4_awq_clip calibrated on as many tokens of a second text, the docstrings of "
                            "CALIBRATION2_MODULES (neither scored nor in CALIBRATION_MODULES): the calibration text's "
                            "share of the figure",
    "int4_awq_clip_g32": "int4_awq_clip in groups of 32",
    "int4_awq_g32": "diagnostic: int4_awq_clip in groups of 32 without the clip search",
    "int4_gptq": "INT4 W4A16 GPTQ (quant/gptq.py), sequential per decoder layer, groups as int4_rtn, float32 scales, "
                 "calibrated on other stdlib modules' docstrings (CALIBRATION_MODULES)",
    "int4_gptq_act_order": "int4_gptq processing input features by descending Hessian diagonal (act-order, perm)",
    "int4_gguf": "the bundled GGUF's own Q4_1 blocks (groups of 32) as INT4 layers, as `--quantization gguf` serves; "
                 "the float32 model is these blocks dequantized, so ~0 by construction",
}
CALIBRATED = ("fp8_gptq", "int4_awq", "int4_awq_gptq", "int4_gptq", "int4_gptq_act_order", "int4_awq_clip",
              "int4_awq_clip_g32", "int4_awq_g32", "int4_awq_clip_calib2")
TARGETS = {"fp8": 0.02, "fp8_gptq": 0.02, "int4_awq_layout": 0.10, "int4_awq": 0.10, "int4_awq_gptq": 0.10,
           "int4_gptq": 0.10, "int4_gptq_act_order": 0.10, "int4_awq_clip": 0.10, "int4_awq_clip_g32": 0.10,
           "int4_awq_clip_calib2": 0.10}  # issue 25's perplexity increase allowed over float32

MODULES = ("json", "collections", "functools", "itertools", "textwrap", "argparse", "re", "string", "pathlib",
           "dataclasses", "heapq", "bisect", "contextlib", "datetime", "fractions", "statistics", "random",
           "logging", "subprocess", "typing", "enum", "abc", "shutil", "tempfile", "csv", "difflib", "inspect")
CALIBRATION2_MODULES = ("email", "http", "urllib", "unittest", "sqlite3", "xml", "asyncio", "hashlib", "struct",
                        "array", "decimal", "operator", "types", "weakref", "traceback", "warnings", "signal",
                        "select", "socket", "ssl", "zlib", "gzip", "bz2", "lzma", "io")


def stdlib_text(min_chars: int, modules: tuple[str, ...] = MODULES) -> str:
    """quant/calibration.py's stdlib_docstrings, of the scored MODULES unless told (none is a CALIBRATION_MODULES)."""
    return stdlib_docstrings(min_chars, modules)


def token_windows(loaded: LoadedModel, text: str, tokens: int, window: int) -> list[list[int]]:
    """The first `tokens` tokens of `text` cut into whole windows of `window`."""
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return [ids[i: i + window] for i in range(0, len(ids) - window + 1, window)]


def build_model(loaded: LoadedModel) -> nn.Module:
    model = architecture_for_type(loaded.config.arch).model_class(loaded.config, None)
    model.load_weights(loaded.state_dict)
    return model.eval()


def checkpoint_model(path: str) -> tuple[nn.Module, int, str]:
    """A quantized checkpoint directory loaded in float32 as model_runner loads it: its quantized layers installed as
    published, the dense rest around them; → (the model, how many quantized layers, its method)."""
    loaded = load_hf_dir(path, torch.float32)
    if not loaded.quantized_linears:
        raise ValueError(f"{path} is not a quantized checkpoint")
    model = architecture_for_type(loaded.config.arch).model_class(loaded.config, None)
    dense = {name: w for name, w in loaded.state_dict.items()
             if name.removesuffix(".weight") not in loaded.quantized_linears}
    model.load_weights({**dense, **install_(model, loaded.quantized_linears)})
    return model.eval(), len(loaded.quantized_linears), loaded.quantization


def through_awq_layout_(model: nn.Module) -> None:
    """Each INT4 layer written to the AutoAWQ GEMM tensors and read back (fp16 scales), scales then in the model's
    float32 again."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.method == "int4":
            weight = from_awq(**to_awq(module.int4_weight()), group_size=module.group_size)
            module.qweight, module.scales, module.zeros = weight.qweight, weight.scales.float(), weight.zeros.float()


def fp8_weights_only_(model: nn.Module) -> int:
    """Each linear but the LM head keeps float activations and gets its FP8-rounded weight (e4m3 times its channel's
    scale): the weights' share of FP8's loss. → how many."""
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(dequantize_fp8(*quantize_weight_fp8(linear.weight)))
    return len(linears)


def quantized(loaded: LoadedModel, variant: str, group_size: int,
              calibration: list[list[int]] | None = None) -> tuple[nn.Module, int]:
    """A fresh model of `loaded` quantized as VARIANTS[variant] says (GPTQ on the `calibration` windows), and how
    many linears that changed."""
    model = build_model(loaded)
    if variant == "int4_awq_clip_calib2":
        if calibration and loaded.tokenizer is not None:  # (a tokenizer-less test model keeps its windows)
            calibration = calibration_windows(loaded.tokenizer, sum(map(len, calibration)), len(calibration[0]),
                                              CALIBRATION2_MODULES)
        variant = "int4_awq_clip"
    if variant == "fp8_weights_only":
        return model, fp8_weights_only_(model)
    if variant in CALIBRATED and not calibration:
        raise ValueError(f"{variant} needs calibration windows")
    if variant == "fp8_gptq":
        return model, calibrate_gptq_(model, calibration, act_order=True, method="fp8")
    if variant == "int4_awq":  # what serving quantizes on load
        replaced = quantize_linears_(model, "awq", group_size=group_size, calibration=calibration)
        through_awq_layout_(model)
        return model, replaced
    if variant in ("int4_awq_clip", "int4_awq_clip_g32"):  # the writer's quantization, as it writes it
        size = checkpoint_group_size(model, 32 if variant.endswith("g32") else group_size)
        return model, quantize_for_checkpoint_(model, "awq", "awq", calibration, size, progress=lambda line: None)
    if variant == "int4_awq_g32":
        scale_activation_aware_(model, calibration, 32)
        replaced = quantize_linears_(model, "awq", group_size=32)
        through_awq_layout_(model)
        return model, replaced
    if variant == "int4_awq_gptq":
        scale_activation_aware_(model, calibration, group_size)
        return model, calibrate_gptq_(model, calibration, group_size, act_order=True)
    if variant.startswith("int4_gptq"):
        return model, calibrate_gptq_(model, calibration, group_size, act_order=variant.endswith("act_order"))
    if variant == "int4_gguf":
        linears = gguf_int4_linears(bundled_gguf_path(), loaded.config, torch.float32)
        install_(model, linears)
        return model, len(linears)
    method = "fp8" if variant == "fp8" else "awq"
    replaced = quantize_linears_(model, method, group_size=32 if variant == "int4_rtn_g32" else group_size)
    if variant == "int4_awq_layout":
        through_awq_layout_(model)
    return model, replaced


def group_sizes(model: nn.Module) -> dict[str, int]:
    """The INT4 group size of each distinct (in_features) shape."""
    return {str(m.in_features): m.group_size for m in model.modules()
            if isinstance(m, QuantizedLinear) and m.method == "int4"}


def measure(model: nn.Module, windows: list[list[int]], reference: list[torch.Tensor] | None
            ) -> tuple[dict, list[torch.Tensor]]:
    """Perplexity over all windows (token-weighted), and against the reference logits (if given) the top-1
    agreement and the mean KL(reference ‖ model) a position; → (that, the logits [T, V] of each window)."""
    start = time.perf_counter()
    logits = [sequence_logits(model, w) for w in windows]  # [T, V] each
    predicted = sum(len(w) - 1 for w in windows)  # each window's first token has nothing before it
    nll = sum(math.log(perplexity(l, w)) * (len(w) - 1) for l, w in zip(logits, windows))
    result: dict = {"perplexity": round(math.exp(nll / predicted), 4)}
    if reference is not None:
        rows = sum(len(w) for w in windows)
        agreed = sum(top1_agreement(l, r) * len(l) for l, r in zip(logits, reference))
        result["top1_agreement"] = round(agreed / rows, 4)
        kl = sum(F.kl_div(l.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum").item()
                 for l, r in zip(logits, reference))
        result["mean_kl_nats"] = round(kl / rows, 5)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens scored in all")
    parser.add_argument("--window", type=int, default=512, help="tokens per independently scored window")
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group size asked for (gcd with K used)")
    parser.add_argument("--calibration-tokens", type=int, default=ON_LOAD_CALIBRATION_TOKENS,
                        help="calibration tokens in all (default: as many as serving calibrates on when it quantizes "
                             "on load)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                        help="default: all, or none where --checkpoint is given")
    parser.add_argument("--checkpoint", default=None,
                        help="also score this quantized checkpoint directory (radixserve quantize --out DIR), loaded "
                             "as serve --model DIR loads it")
    parser.add_argument("--checkpoint-name", default="checkpoint", help="the checkpoint's result name")
    parser.add_argument("--merge", action="store_true", help="keep --out's other variants' results")
    parser.add_argument("--out", default=None, help="JSON result path")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_bundled(dtype=torch.float32)
    windows = token_windows(loaded, stdlib_text(args.tokens * 8), args.tokens, args.window)
    calibration = calibration_windows(loaded.tokenizer, args.calibration_tokens, args.window)

    variants, targets = dict(VARIANTS), dict(TARGETS)
    names = args.variants if args.variants is not None else ([] if args.checkpoint else list(VARIANTS))
    if args.checkpoint:
        names = [*names, args.checkpoint_name]
    base, reference = measure(build_model(loaded), windows, None)
    results = {"float32": base}
    for name in names:
        start = time.perf_counter()
        if name == args.checkpoint_name:
            model, replaced, method = checkpoint_model(args.checkpoint)
            variants[name] = (f"the {method} checkpoint {args.checkpoint}, as `radixserve quantize` wrote it and "
                              "`serve --model DIR` loads it (quant/checkpoint.py: its layers as published)")
            targets[name] = TARGETS["fp8" if method == "fp8" else "int4_awq"]
        else:
            model, replaced = quantized(loaded, name, args.group_size, calibration)
        quantize_seconds = time.perf_counter() - start
        result, _ = measure(model, windows, reference)
        result["perplexity_vs_float"] = round(result["perplexity"] / base["perplexity"] - 1, 4)
        if name in targets:
            result["target_perplexity_vs_float"] = targets[name]
            result["within_target"] = result["perplexity_vs_float"] <= targets[name]
        result["linears_quantized"] = replaced
        if name in CALIBRATED:
            result["calibration_seconds"] = round(quantize_seconds, 2)
        if name.startswith("int4"):
            result["group_size_by_in_features"] = group_sizes(model)
        results[name] = result
        print(name, result, flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"bench": "quant_quality", "model": loaded.config.model_id, "commit": commit, "device": "cpu",
              "hardware": platform.processor() or platform.machine(), "python": platform.python_version(),
              "torch": torch.__version__, "text": f"docstrings of {len(MODULES)} stdlib modules",
              "tokens_scored": sum(len(w) for w in windows), "windows": len(windows), "window": args.window,
              "calibration_text": f"docstrings of {len(CALIBRATION_MODULES)} other stdlib modules: "
                                  + ", ".join(CALIBRATION_MODULES),
              "calibration_tokens": sum(len(w) for w in calibration),
              "lm_head": "dense (tied embedding)", "variants": variants, "results": results}
    report["measured_at_commit"] = {name: commit for name in results}
    if args.merge and args.out:
        with open(args.out) as f:
            kept = json.load(f)
        merged = {**kept["results"], **results}
        report["variants"] = {**kept["variants"], **variants}
        report["results"] = {name: merged[name] for name in ("float32", *report["variants"]) if name in merged}
        report["measured_at_commit"] = {name: kept.get("measured_at_commit", {}).get(name, kept["commit"])
                                        for name in report["results"]} | report["measured_at_commit"]
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
