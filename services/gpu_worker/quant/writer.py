"""Writing a model's quantized weights once, as a published checkpoint (`radixserve quantize`), so serving loads them as
they are (quant/checkpoint.py) instead of calibrating on load.

    fp8   compressed-tensors FP8-Dynamic: <layer>.weight e4m3 [N, K], <layer>.weight_scale float32 [N, 1];
          calibration "gptq" (quant/gptq.py gptq_quantize_fp8, act-order, layer by layer) or "rtn"
    awq   AutoAWQ GEMM INT4: <layer>.qweight, .qzeros, .scales (fp16); calibration "awq" (activation-aware scales
          folded into the norms and v/up rows, quant/awq.py; each group's grid, fp16 scale and integer zero point,
          searched by quant/clip.py search_grid; the integers on those grids by GPTQ's error feedback, quant/gptq.py
          gptq_quantize_on_grid; every search through the calibration inputs' shrunk Gram matrix) or "rtn"
    gptq  GPTQ v1 INT4: <layer>.qweight, .qzeros, .scales (fp16), .g_idx; calibration "gptq" (act-order) or "rtn"

Every other tensor (embeddings, norms, folded or not, the LM head) is written dense, in the source checkpoint's dtype,
under the model's own names, all in one model.safetensors; config.json is the source's with a `quantization_config`
that checkpoint_method accepts, and the tokenizer and generation files are copied. INT4 uses one group size for every
layer (the config holds one): the requested size's gcd with every layer's K (SmolLM2-135M: 64). The in-memory model
is left holding the quantized layers as the checkpoint holds them (INT4 scales rounded to fp16 as written), so from a
float32 source it and the served checkpoint compute the same numbers (a bf16 source's dense rest is rounded on write).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.gpu_worker.model.architecture import same_weights
from services.gpu_worker.model.loader import LoadedModel, hf_config_dict, load_model, model_shapes
from services.gpu_worker.model.registry import architecture_for_type
from services.gpu_worker.quant.apply import quantize_linears_
from services.gpu_worker.quant.awq import scale_activation_aware_
from services.gpu_worker.quant.calibration import (AWQ_WRITER_CALIBRATION_TOKENS, ON_LOAD_CALIBRATION_TOKENS,
                                                   calibration_windows)
from services.gpu_worker.quant.gptq import calibrate_gptq_
from services.gpu_worker.quant.int4 import from_awq, from_gptq, to_awq, to_gptq
from services.gpu_worker.quant.linear import QuantizedLinear, int4_group_size
from services.gpu_worker.quant.targets import linear_targets

CALIBRATIONS = {"fp8": ("gptq", "rtn"), "awq": ("awq", "rtn"), "gptq": ("gptq", "rtn")}
"""The methods `radixserve quantize` writes, and the calibrations each takes (the first is its default)."""
CALIBRATION_WINDOW = 512
_SKIPPED_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Progress = Callable[[str], None]


def quantization_config(method: str, group_size: int, act_order: bool = False) -> dict[str, Any]:
    """config.json's `quantization_config` of a checkpoint written in `method` (INT4 groups of `group_size`; GPTQ's
    desc_act says whether g_idx is act-order)."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
                "checkpoint_format": "gptq"}
    if method == "fp8":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {**fp8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**fp8, "strategy": "token", "dynamic": True}}}}
    raise ValueError(f"unknown quantization method {method!r}: one of {', '.join(CALIBRATIONS)}")


def check_method(method: str, calibration: str | None) -> str:
    """→ the calibration to use (the method's default where None); ValueError naming the choices otherwise."""
    if method not in CALIBRATIONS:
        raise ValueError(f"unknown quantization method {method!r}: one of {', '.join(CALIBRATIONS)}")
    calibration = calibration or CALIBRATIONS[method][0]
    if calibration not in CALIBRATIONS[method]:
        raise ValueError(f"--method {method} takes --calibration {' or '.join(CALIBRATIONS[method])}, "
                         f"not {calibration!r}")
    return calibration


def checkpoint_group_size(model: nn.Module, requested: int = 128) -> int:
    """One INT4 group size for every layer a quantizer replaces: `requested`'s gcd with each one's K."""
    return int4_group_size(math.gcd(*(child.in_features for *_, child in linear_targets(model))), requested)


def quantize_for_checkpoint_(model: nn.Module, method: str, calibration: str, windows: list[list[int]] | None,
                             group_size: int, progress: Progress = print) -> int:
    """Quantize `model`'s linear layers in place as `method` with `calibration` on the token `windows` (needed
    unless "rtn"), leaving them exactly as layer_tensors writes them → how many layers."""
    if calibration != "rtn" and not windows:
        raise ValueError(f"{calibration} calibration needs token windows of calibration text, and has none")
    started = time.perf_counter()
    total = len(model.model.layers)

    def on_layer(name: str, num_linears: int) -> None:
        progress(f"{name}: {num_linears} linears quantized ({time.perf_counter() - started:.0f}s)")

    def on_group(layer_index: int, alpha: float) -> None:
        progress(f"model.layers.{layer_index}: activation-aware scales, alpha {alpha:.2f} "
                 f"({time.perf_counter() - started:.0f}s)")

    if calibration == "rtn":
        replaced = quantize_linears_(model, method, group_size=group_size)
        progress(f"{replaced} linears of {total} decoder layers rounded to nearest")
    elif method == "awq":
        grids: dict = {}
        scale_activation_aware_(model, windows, group_size, on_group=on_group, grids=grids)
        replaced = quantize_linears_(model, method, group_size=group_size, grids=grids)
    else:
        replaced = calibrate_gptq_(model, windows, group_size, act_order=True, method="fp8" if method == "fp8"
                                   else "int4", on_layer=on_layer)
    if method != "fp8":
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                as_written_(module, method)
    return replaced


def as_written_(linear: QuantizedLinear, method: str) -> None:
    """An INT4 layer's scales and zeros as the checkpoint holds them (fp16 scales), back in the layer's dtype."""
    parts = layer_tensors(linear, method)
    read = (from_awq(parts["qweight"], parts["qzeros"], parts["scales"], linear.group_size) if method == "awq" else
            from_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], linear.group_size))
    dtype = linear.scales.dtype
    linear.qweight, linear.scales, linear.zeros, linear.perm = (read.qweight, read.scales.to(dtype),
                                                                read.zeros.to(dtype), read.perm)


def layer_tensors(linear: QuantizedLinear, method: str) -> dict[str, torch.Tensor]:
    """One quantized layer → its checkpoint tensors by suffix (module docstring), its bias (if any) as it is."""
    if method == "fp8":
        parts = {"weight": linear.qweight, "weight_scale": linear.weight_scale.float()[:, None]}
    elif method == "awq":
        parts = to_awq(linear.int4_weight())
    else:
        parts = to_gptq(linear.int4_weight())
    if linear.bias is not None:
        parts["bias"] = linear.bias
    return {suffix: tensor.contiguous() for suffix, tensor in parts.items()}


def checkpoint_tensors(model: nn.Module, shapes: dict[str, tuple[int, ...]], method: str,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The quantized model's safetensors: each QuantizedLinear's layer_tensors under its name, and every other tensor
    of `shapes` (the model's own names) dense in `dtype`."""
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            tensors.update({f"{name}.{suffix}": t for suffix, t in layer_tensors(module, method).items()})
    quantized = {name.rsplit(".", 1)[0] for name in tensors}
    for name in shapes:
        if name.rsplit(".", 1)[0] not in quantized:
            tensors[name] = state[name].to(dtype).contiguous()
    return tensors


def prepare_out_dir(out: Path) -> None:
    """Fail early, before any calibration, where `out` is a file, a non-empty directory, or not writable."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not an empty directory: choose a new one")
    parent = out.parent if not out.exists() else out
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror or e})") from e


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                     source_dir: str | None, tokenizer: Any) -> None:
    """config.json, model.safetensors and the source's other files (tokenizer, generation config), or the tokenizer
    saved where there is no source directory, into `out`, which appears whole or not at all."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if source_dir is not None:
            for file in Path(source_dir).iterdir():
                if file.is_file() and file.name != "config.json" and not file.name.endswith(_SKIPPED_FILES):
                    shutil.copy2(file, tmp / file.name)
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()  # empty (prepare_out_dir)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class QuantizeSummary:
    out: Path
    method: str
    calibration: str
    num_layers: int
    group_size: int | None  # INT4 only
    calibration_tokens: int
    seconds: float


def quantize_checkpoint(model_spec: str, method: str, out: str | Path, calibration: str | None = None,
                        calibration_tokens: int | None = None, group_size: int = 128,
                        progress: Progress = print) -> QuantizeSummary:
    """Load `model_spec` (as `serve --model` does) in float32, quantize it (quantize_for_checkpoint_) and write it
    to `out` (module docstring). calibration_tokens None: AWQ_WRITER_CALIBRATION_TOKENS for awq, else
    ON_LOAD_CALIBRATION_TOKENS."""
    calibration = check_method(method, calibration)
    if calibration_tokens is None:
        calibration_tokens = AWQ_WRITER_CALIBRATION_TOKENS if method == "awq" else ON_LOAD_CALIBRATION_TOKENS
    if calibration != "rtn" and calibration_tokens < 1:
        raise ValueError(f"--calibration-tokens must be at least 1, not {calibration_tokens}")
    out = Path(out).expanduser().resolve()
    prepare_out_dir(out)
    started = time.perf_counter()
    loaded = load_model(model_spec, dtype=torch.float32)
    if loaded.quantization is not None:
        raise ValueError(f"{model_spec} is already quantized ({loaded.quantization}): quantize a dense checkpoint")
    arch = architecture_for_type(loaded.config.arch)
    if arch.to_model_weights is not same_weights:
        raise ValueError(f"{arch.hf_name} checkpoints cannot be written quantized: its loader maps the checkpoint's "
                         "weights to other names or shapes (quantize it on load with serve --quantization)")
    if calibration != "rtn" and loaded.tokenizer is None:
        raise ValueError(f"{calibration} calibration runs the model over text: {model_spec} has no tokenizer "
                         "(use --calibration rtn)")
    model = float_model(loaded)
    size = checkpoint_group_size(model, group_size) if method != "fp8" else group_size
    windows = None
    if calibration != "rtn":
        windows = calibration_windows(loaded.tokenizer, calibration_tokens, min(CALIBRATION_WINDOW, calibration_tokens))
    num_tokens = sum(map(len, windows or []))
    progress(f"quantizing {model_spec} to {method} ({calibration}"
             f"{f', {num_tokens} calibration tokens' if windows else ''}"
             f"{f', groups of {size}' if method != 'fp8' else ''})")
    num_layers = quantize_for_checkpoint_(model, method, calibration, windows, size, progress)
    write_quantized_model(out, model, loaded, method, size)
    seconds = time.perf_counter() - started
    progress(f"wrote {out} ({num_layers} quantized linears) in {seconds:.0f}s")
    return QuantizeSummary(out, method, calibration, num_layers, None if method == "fp8" else size, num_tokens,
                           seconds)


def write_quantized_model(out: Path, model: nn.Module, loaded: LoadedModel, method: str, group_size: int) -> None:
    """`model` (loaded's, quantized by quantize_for_checkpoint_) written to `out` beside loaded's config and
    tokenizer."""
    tensors = checkpoint_tensors(model, model_shapes(loaded.config), method, _source_dtype(loaded))
    act_order = any(isinstance(m, QuantizedLinear) and m.method == "int4" and m.perm is not None
                    for m in model.modules())
    config = {**_source_config(loaded), "quantization_config": quantization_config(method, group_size, act_order)}
    write_checkpoint(out, tensors, config, loaded.source_dir, loaded.tokenizer)


def float_model(loaded: LoadedModel) -> nn.Module:
    """loaded's model in float32 on the CPU, as the quantizers take it."""
    model = architecture_for_type(loaded.config.arch).model_class(loaded.config, None)
    model.load_weights(loaded.state_dict)
    return model.eval()


def _source_config(loaded: LoadedModel) -> dict[str, Any]:
    if loaded.source_dir is not None:
        return json.loads((Path(loaded.source_dir) / "config.json").read_text())
    return hf_config_dict(loaded.config)


def _source_dtype(loaded: LoadedModel) -> torch.dtype:
    """The dtype the source checkpoint's config names (torch_dtype, or transformers' newer `dtype`); float32 else."""
    config = _source_config(loaded)
    name = config.get("torch_dtype") or config.get("dtype")
    return _DTYPES.get(str(name), torch.float32)
