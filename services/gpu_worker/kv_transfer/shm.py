"""Shared-memory backend: a CPU prefill worker's KV pool lives in a POSIX shared-memory segment; a decode
worker on the same host maps it read-only by name and copies exactly the pages it needs."""
from __future__ import annotations

import threading
import warnings
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from services.gpu_worker.kv_cache import KVCache, select_pages
from services.gpu_worker.kv_transfer.base import DTYPES, TransferError, check_compatible, copy_into, page_shape
from shared.messages import KVSource

SHM_DIR = Path("/dev/shm")
MAX_MAPPED_POOLS = 8  # prefill workers a decode worker keeps mapped (older mappings are dropped)


class SharedKVPool:
    """Moves a KVCache's k and v into one new segment `name` (k then v); the pool is used as before.

    NOTE: call before the engine's first step; the segment is unlinked at close() (and, if the process
    dies, by Python's resource tracker).
    """

    def __init__(self, kv: KVCache, name: str) -> None:
        if kv.k.device.type != "cpu":
            raise ValueError("a shared-memory KV pool needs a cpu KV cache")
        num_bytes = kv.k.numel() * kv.k.element_size()
        self.name = name
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=2 * num_bytes)
        flat = torch.frombuffer(self._shm.buf, dtype=kv.k.dtype, count=2 * kv.k.numel())  # [2 * L*P*S*KVH*D]
        k = flat[: kv.k.numel()].view(kv.k.shape)  # [L, P, S, KVH, D]
        v = flat[kv.k.numel():].view(kv.v.shape)  # [L, P, S, KVH, D]
        k.copy_(kv.k)
        v.copy_(kv.v)
        kv.k, kv.v = k, v

    def close(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class ShmPuller:
    """Maps each source segment once (read-only) and gathers pages from it."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _pool(self, source: KVSource) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            pool = self._maps.pop(source.shm_name, None) or _map_read_only(source)
            self._maps[source.shm_name] = pool  # most recently used last
            while len(self._maps) > MAX_MAPPED_POOLS:  # NOTE: a mapping keeps a dead worker's segment alive
                self._maps.pop(next(iter(self._maps)))
            return pool

    def pull(self, source: KVSource, lease_id: str, src_page_ids: list[int], dst_page_ids: list[int],
             kv: KVCache) -> int:
        check_compatible(source, kv)
        k_src, v_src = self._pool(source)
        index = torch.tensor(src_page_ids, dtype=torch.long)
        k, v = select_pages(k_src, index), select_pages(v_src, index)  # [L, n, S, KVH, D]
        copy_into(kv, dst_page_ids, k, v)
        return 2 * k.numel() * k.element_size()

    def forget(self, shm_name: str) -> None:
        with self._lock:
            self._maps.pop(shm_name, None)


def _map_read_only(source: KVSource) -> tuple[torch.Tensor, torch.Tensor]:
    shape = page_shape(source)
    dtype = DTYPES[source.dtype]
    count = int(np.prod(shape))
    try:
        array = np.memmap(SHM_DIR / source.shm_name, dtype=np.uint8, mode="r")
    except (FileNotFoundError, ValueError) as exc:
        raise TransferError(f"shared KV pool {source.shm_name!r} is gone: {exc}") from exc
    element = torch.empty((), dtype=dtype).element_size()
    if array.size < 2 * count * element:
        raise TransferError(f"shared KV pool {source.shm_name!r} is smaller than its layout")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: we never write through it
        flat = torch.frombuffer(array, dtype=dtype, count=2 * count)
    return flat[:count].view(shape), flat[count:].view(shape)
