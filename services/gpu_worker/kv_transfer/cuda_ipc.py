"""CUDA IPC backend: a GPU prefill worker shares its KV pool's storages through torch's CUDA IPC handles;
a decode worker on the same host opens them once and gathers pages device to device on its own stream.

Only the handle conversion is exercised on CPU machines; the copy path runs on the GPU test machine.
"""
from __future__ import annotations

import threading

import torch

from services.gpu_worker.kv_cache import KVCache, select_pages
from services.gpu_worker.kv_transfer.base import DTYPES, TransferError, check_compatible, copy_into, page_shape
from services.gpu_worker.staging import to_device
from shared.messages import CudaIpcHandle, KVSource


def handle_from_share(shared: tuple) -> CudaIpcHandle:
    """`UntypedStorage._share_cuda_()`'s 8-tuple as its wire form."""
    device, handle, size, offset, ref_handle, ref_offset, event, event_sync = shared
    return CudaIpcHandle(int(device), bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
                         bytes(event), bool(event_sync))


def share_args(handle: CudaIpcHandle) -> tuple:
    """The wire form back as `UntypedStorage._new_shared_cuda`'s arguments."""
    return (handle.device, handle.handle, handle.size_bytes, handle.offset_bytes, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)


def export_handles(kv: KVCache) -> tuple[CudaIpcHandle, CudaIpcHandle]:
    """Handles of the pool's K and V storages (the exporting process must keep kv alive)."""
    if kv.k.device.type != "cuda":
        raise ValueError("CUDA IPC needs a cuda KV cache")
    return (handle_from_share(kv.k.untyped_storage()._share_cuda_()),
            handle_from_share(kv.v.untyped_storage()._share_cuda_()))


def open_pool(source: KVSource) -> tuple[torch.Tensor, torch.Tensor]:
    """The source pool's K and V as tensors of this process, over the shared device memory (on the device
    torch opens the handle on; the puller copies across GPUs when that is not its own)."""
    if source.cuda_k is None or source.cuda_v is None:
        raise TransferError("the source offers no CUDA IPC handles")
    shape = page_shape(source)
    dtype = DTYPES[source.dtype]
    tensors = []
    for handle in (source.cuda_k, source.cuda_v):
        storage = torch.UntypedStorage._new_shared_cuda(*share_args(handle))
        # NOTE: the tensor lives where the storage does (the source worker's GPU), which may not be `device`
        tensors.append(torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, shape))
    return tensors[0], tensors[1]


class CudaIpcPuller:
    """Opens each source pool once; copies page to page (kernels/page_copy.py) on a side stream, so the
    engine's compute stream keeps going."""

    def __init__(self) -> None:
        self._pools: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def pull(self, source: KVSource, lease_id: str, src_page_ids: list[int], dst_page_ids: list[int],
             kv: KVCache) -> int:
        from services.gpu_worker.kernels.page_copy import copy_pages_  # imports triton

        check_compatible(source, kv)
        device = kv.k.device
        with self._lock:
            key = source.cuda_k.handle if source.cuda_k is not None else b""
            if key not in self._pools:
                self._pools[key] = open_pool(source)
            k_src, v_src = self._pools[key]
            stream = self._streams.setdefault(device.index or 0, torch.cuda.Stream(device))
        if k_src.device == device:
            with torch.cuda.stream(stream):
                src = to_device(src_page_ids, torch.int32, device)
                dst = to_device(dst_page_ids, torch.int32, device)
                copy_pages_(kv.k, kv.v, k_src, v_src, src, dst)  # page to page: each byte read once, written once
        else:  # the source pool is on another GPU of this host: gather there, then one peer copy per tensor
            with torch.cuda.device(k_src.device):
                index = to_device(src_page_ids, torch.long, k_src.device)
                k, v = select_pages(k_src, index), select_pages(v_src, index)  # [L, n, S, KVH, D]
            with torch.cuda.stream(stream):
                copy_into(kv, dst_page_ids, k, v)
            torch.cuda.synchronize(k_src.device)
        stream.synchronize()
        return 2 * len(src_page_ids) * kv.k[:, 0].numel() * kv.k.element_size()
