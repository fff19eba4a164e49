"""Every served architecture, in one table: config.json's `architectures[0]` picks the entry.

Adding a family: a file in model/ that declares an `Architecture` (see phi3.py), and a line in ARCHITECTURES."""
from __future__ import annotations

from services.gpu_worker.model import gemma2, gemma3, llama_family, moe_families, phi3
from services.gpu_worker.model.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    arch.hf_name: arch
    for arch in (
        llama_family.LLAMA,
        llama_family.MISTRAL,
        llama_family.QWEN2,
        llama_family.QWEN3,
        phi3.PHI3,
        moe_families.MIXTRAL,
        moe_families.QWEN3_MOE,
        gemma2.GEMMA2,
        gemma3.GEMMA3,
    )
}
_BY_MODEL_TYPE = {arch.model_type: arch for arch in ARCHITECTURES.values()}


def architecture_for_hf(cfg_dict: dict) -> Architecture:
    """The entry for a config.json dict: by `architectures[0]`, or by `model_type` where that list is absent."""
    names = cfg_dict.get("architectures") or []
    if names:
        if names[0] not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {names[0]!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        return ARCHITECTURES[names[0]]
    return architecture_for_type(cfg_dict.get("model_type"))


def architecture_for_type(model_type: str | None) -> Architecture:
    """The entry whose `model_type` (ModelConfig.arch) this is: random presets and GGUF files map here."""
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(_BY_MODEL_TYPE)}"
        )
    return _BY_MODEL_TYPE[model_type]
