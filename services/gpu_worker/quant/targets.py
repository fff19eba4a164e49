"""Which layers a quantizer replaces: every nn.Linear of a model except those that must stay dense.

Left dense: the LM head (`lm_head`: its logits feed sampling directly and it is a small share of a big model's
bytes), a mixture-of-experts router (a module named `gate` whose parent has `experts`: a flipped top-k choice costs
more than its few bytes save) and any name in `skip`. Embeddings and the fused experts' tensors are not nn.Linear,
so they stay as they are. Both the plain quantizer (quant/apply.py) and the calibrated ones (quant/awq.py,
quant/gptq.py, quant/writer.py) walk this list.
"""
from __future__ import annotations

from torch import nn


def linear_targets(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)
                   ) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """The nn.Linear layers a quantizer replaces, in module order: (qualified name, parent, name in the parent, the
    layer) for each one unless a component of its qualified name is in `skip` or it is an MoE router."""
    return [
        (f"{parent_name}.{name}" if parent_name else name, parent, name, child)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and not _is_skipped(f"{parent_name}.{name}", parent, name, skip)
    ]


def _is_skipped(qualified: str, parent: nn.Module, name: str, skip: tuple[str, ...]) -> bool:
    is_router = name == "gate" and hasattr(parent, "experts")
    return is_router or any(part in skip for part in qualified.split("."))
