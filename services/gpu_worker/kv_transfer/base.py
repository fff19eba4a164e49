"""The transfer interface, backend selection by placement (pure), and the page layout both sides share."""
from __future__ import annotations

import socket
from typing import Protocol

import torch

from services.gpu_worker.kv_cache import KVCache, raw
from shared.messages import KVSource

BACKENDS = ("auto", "shm", "cuda_ipc", "stream")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}


class TransferError(Exception):
    """A pull could not complete (source gone, lease over, layout mismatch); the caller recomputes."""


class KVPuller(Protocol):
    def pull(self, source: KVSource, lease_id: str, src_page_ids: list[int], dst_page_ids: list[int],
             kv: KVCache) -> int:
        """Copy the source's pages src_page_ids[i] into kv's pages dst_page_ids[i] (every layer, K and V);
        return the bytes copied. Blocking: run it off the engine thread. Raises TransferError."""
        ...


def select_backend(source: KVSource, local_host_id: str, local_device_type: str, override: str = "auto") -> str:
    """shm on one host between CPU pools, cuda_ipc on one host between GPU pools, else stream.

    override (a worker's --kv-transfer) forces a backend; a forced one the source cannot offer raises
    TransferError rather than silently moving bytes another way.
    """
    if override not in BACKENDS:
        raise ValueError(f"kv transfer backend must be one of {', '.join(BACKENDS)}, not {override!r}")
    same_host = source.host_id == local_host_id
    offered = {"stream": bool(source.stream_addr), "shm": bool(source.shm_name) and same_host,
               "cuda_ipc": source.cuda_k is not None and same_host and local_device_type == "cuda"}
    if override != "auto":
        if not offered[override]:
            raise TransferError(f"the source offers no {override} path to this worker")
        return override
    if same_host and source.device_type == "cpu" and offered["shm"]:
        return "shm"
    if same_host and source.device_type == "cuda" and offered["cuda_ipc"]:
        return "cuda_ipc"
    if offered["stream"]:
        return "stream"
    raise TransferError("the source offers no path to this worker")


def default_host_id() -> str:
    return socket.gethostname()


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def page_shape(source: KVSource) -> tuple[int, int, int, int, int]:
    """The pool's shape, [num_layers, num_pages, page_size, num_kv_heads, head_dim], for K and for V."""
    return source.num_layers, source.num_pages, source.page_size, source.num_kv_heads, source.head_dim


def check_compatible(source: KVSource, kv: KVCache) -> None:
    """Pages move only between pools of one layout (same model, page size and dtype)."""
    here = (kv.k.shape[0], kv.k.shape[2], kv.k.shape[3], kv.k.shape[4], dtype_name(kv.k.dtype))
    there = (source.num_layers, source.page_size, source.num_kv_heads, source.head_dim, source.dtype)
    if here != there:
        raise TransferError(f"KV layout differs: source {there}, here {here}")


def copy_into(kv: KVCache, dst_page_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write pages into kv. k, v: [num_layers, len(dst_page_ids), page_size, num_kv_heads, head_dim]."""
    index = torch.tensor(dst_page_ids, dtype=torch.long, device=kv.k.device)
    raw(kv.k).index_copy_(1, index, raw(k.to(device=kv.k.device, dtype=kv.k.dtype, non_blocking=True)))
    raw(kv.v).index_copy_(1, index, raw(v.to(device=kv.v.device, dtype=kv.v.dtype, non_blocking=True)))
