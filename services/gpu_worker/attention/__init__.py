"""Attention backends over the paged KV layout: the torch reference (any device) and Triton kernels (CUDA)."""
from services.gpu_worker.attention.base import AttentionBackend, AttentionMetadata
from services.gpu_worker.attention.torch_ref import TorchAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention", "make_backend"]


def make_backend(name: str, device: str) -> AttentionBackend:
    """"auto" picks Triton on CUDA and the torch reference elsewhere; "torch" is the reference everywhere."""
    if name == "torch" or (name == "auto" and device != "cuda"):
        return TorchAttention()
    if name in ("auto", "triton"):
        from services.gpu_worker.attention.triton_backend import TritonAttention  # imports triton: CUDA only

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (choices: auto, torch, triton)")
