"""Quantized Hugging Face checkpoints written by our own quantizers in the published layouts (AutoAWQ GEMM, GPTQ v1,
compressed-tensors FP8), and the dense checkpoint each one dequantizes to (tests/unit/test_quant_checkpoint.py,
tests/e2e/test_quantized_serve.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.gpu_worker.quant.fp8 import dequantize_fp8, quantize_weight_fp8
from services.gpu_worker.quant.int4 import dequantize_int4, quantize_int4
from services.gpu_worker.quant.linear import QuantizedLinear
from services.gpu_worker.quant.writer import as_written_, layer_tensors, quantization_config

def tiny_dense_llama(directory: str) -> Path:
    """A random 2-layer Llama checkpoint (hidden 64, 4 query and 2 kv heads, intermediate 128, vocab 256) saved in
    `directory`: the dense model the quantized checkpoints are written from."""
    import transformers

    from tests.unit.hf_checkpoints import save_checkpoint

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    path, _ = save_checkpoint(transformers.LlamaForCausalLM(cfg), directory, "dense")
    return path


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def write_quantized(dense_dir: Path, out_dir: Path, method: str, group_size: int) -> tuple[Path, Path]:
    """dense_dir (config.json, one model.safetensors, tokenizer files) → (out_dir: its decoder linears quantized in
    `method`'s published layout; out_dir.parent / (out_dir.name + "-dequantized"): the same model with each of those
    layers replaced by the float32 weights the quantized one stands for)."""
    dequantized_dir = out_dir.parent / f"{out_dir.name}-dequantized"
    for target in (out_dir, dequantized_dir):
        shutil.copytree(dense_dir, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(next(dense_dir.glob("*.safetensors"))))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_linear(name):
            quantized[name] = dequantized[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        parts, dense = _quantize(tensor.float(), method, group_size)
        quantized.update({f"{prefix}.{key}": value.contiguous() for key, value in parts.items()})
        dequantized[name] = dense.to(tensor.dtype)
    save_file(quantized, str(out_dir / "model.safetensors"))
    save_file(dequantized, str(dequantized_dir / "model.safetensors"))
    config = json.loads((dense_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(
        {**config, "quantization_config": quantization_config(method, group_size)}, indent=1))
    return out_dir, dequantized_dir


def _quantize(weight: torch.Tensor, method: str, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One [N, K] weight → (its checkpoint tensors, the float32 weight they dequantize to, as the loader reads them)."""
    if method == "fp8":
        layer = QuantizedLinear.fp8(*quantize_weight_fp8(weight))
        return layer_tensors(layer, method), dequantize_fp8(layer.qweight, layer.weight_scale)
    layer = QuantizedLinear.int4(quantize_int4(weight, group_size))
    as_written_(layer, method)  # the scales rounded to fp16, as the checkpoint holds them
    return layer_tensors(layer, method), dequantize_int4(layer.int4_weight()).float()
