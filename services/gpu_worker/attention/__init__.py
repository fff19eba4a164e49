"""Attention backends over the paged KV layout: a torch reference here; Triton kernels plug in beside it."""
from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.attention.torch_ref import TorchAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention", "make_backend"]


def make_backend(name: str, device: str) -> AttentionBackend:
    """"auto" picks the fastest backend for the device; "torch" is the reference everywhere."""
    if name in ("auto", "torch"):
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (choices: auto, torch)")
