"""The prefill side's half of the transfer: put the pool where decode workers can read it, and describe it."""
from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.kv_cache import KVCache
from services.gpu_worker.kv_transfer.base import dtype_name
from services.gpu_worker.kv_transfer.shm import SharedKVPool
from shared.messages import KVSource


@dataclass
class ExportedPool:
    source: KVSource
    shared: SharedKVPool | None = None

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


def export_pool(kv: KVCache, host_id: str, shm_name: str, stream_addr: str, backend: str = "auto") -> ExportedPool:
    """Share kv by every path its device allows (shm on cpu, CUDA IPC on cuda) unless backend forces stream.

    NOTE: call before the engine's first step: the shm path moves the pool into the segment.
    """
    device_type = kv.k.device.type
    shared = None
    cuda_k = cuda_v = None
    if device_type == "cpu" and backend in ("auto", "shm"):
        shared = SharedKVPool(kv, shm_name)
    if device_type == "cuda" and backend in ("auto", "cuda_ipc"):
        from services.gpu_worker.kv_transfer.cuda_ipc import export_handles
        cuda_k, cuda_v = export_handles(kv)
    num_layers, num_pages, page_size, num_kv_heads, head_dim = kv.k.shape
    source = KVSource(host_id, device_type, num_layers, num_pages, page_size, num_kv_heads, head_dim,
                      dtype_name(kv.k.dtype), stream_addr=stream_addr,
                      shm_name=shared.name if shared is not None else "", cuda_k=cuda_k, cuda_v=cuda_v)
    return ExportedPool(source, shared)
