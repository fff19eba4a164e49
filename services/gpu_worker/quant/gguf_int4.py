"""The bundled GGUF's own 4-bit blocks as INT4 W4A16 weights (`--quantization gguf`), never dequantized first.

llama.cpp's Q4_0 and Q4_1 blocks hold 32 weights of one row: an fp16 scale d (Q4_1: and an fp16 min m) and 16 bytes
of nibbles, byte j's low nibble the block's weight j and its high nibble weight j + 16. They dequantize to
d·(q − 8) (Q4_0) and d·q + m (Q4_1), which is int4.py's (q − zero)·scale with groups of 32, scale d and zero 8 or
−m/d: the integers are the file's own, the scales its fp16 values, and the zero of Q4_1 a float (the W4A16 kernel
and the reference path take any float zero). Rows of q_proj and k_proj are put back from llama.cpp's RoPE order as
the dense loader does (loader.unpermute_qk).
"""
from __future__ import annotations

from pathlib import Path
import numpy as np
import torch

from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.quant.int4 import Int4Weight, pack_int4
from services.gpu_worker.quant.linear import QuantizedLinear

BLOCK = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def q4_blocks_to_int4(raw: np.ndarray, type_name: str, n: int, k: int) -> Int4Weight:
    """A Q4_0 / Q4_1 tensor's bytes (uint8, n rows of k // 32 blocks) → Int4Weight (groups of 32, float32 scales)."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF blocks of type {type_name} are not 4-bit blocks this loader reads (Q4_0, Q4_1)")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, _BLOCK_BYTES[type_name])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K / 32]
    nibbles = blocks[..., -16:]  # [N, K / 32, 16]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(n, k)  # weight j, then j + 16
    if type_name == "Q4_0":
        zero = np.full_like(scale, 8.0)
    else:
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = np.divide(-minimum, scale, out=np.zeros_like(scale), where=scale != 0)
    return Int4Weight(pack_int4(torch.from_numpy(q.astype(np.int32))), torch.from_numpy(scale),
                      torch.from_numpy(zero), BLOCK)


def gguf_int4_linears(gguf_path: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, QuantizedLinear]:
    """Each 4-bit decoder linear layer of the GGUF file → {model module name: QuantizedLinear} (scales and zeros in
    `dtype`); tensors of other types (the Q8_0 embeddings, F32 norms) are left to the dense loader."""
    import gguf

    from services.gpu_worker.model.loader import gguf_hf_name, unpermute_qk

    reader = gguf.GGUFReader(gguf_path)
    linears: dict[str, QuantizedLinear] = {}
    for tensor in reader.tensors:
        name = gguf_hf_name(tensor.name)
        if tensor.tensor_type.name not in _BLOCK_BYTES or not name.endswith("_proj.weight"):
            continue
        k, n = (int(d) for d in tensor.shape)  # GGUF lists the contiguous dimension first
        weight = q4_blocks_to_int4(tensor.data, tensor.tensor_type.name, n, k)
        num_heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(name.split(".")[-2])
        if num_heads is not None:
            rows = unpermute_qk(torch.arange(n).reshape(n, 1), num_heads).reshape(n)
            weight = Int4Weight(weight.qweight[rows], weight.scales[rows], weight.zeros[rows], BLOCK)
        weight.scales, weight.zeros = weight.scales.to(dtype), weight.zeros.to(dtype)
        linears[name.removesuffix(".weight")] = QuantizedLinear.int4(weight)
    if not linears:
        raise ValueError(f"{gguf_path} holds no Q4_0 / Q4_1 linear layers for --quantization gguf")
    return linears

