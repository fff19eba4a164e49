"""Moving a prompt's KV pages from a prefill worker's pool into a decode worker's, by page id.

One interface (`KVPuller.pull`), three backends chosen by placement (`select_backend`): shared memory
(`shm.py`, CPU workers of one host), CUDA IPC (`cuda_ipc.py`, GPU workers of one host) and a byte
stream over ZeroMQ (`stream.py`, anywhere). Only page ids cross the wire for the first two.
"""
from services.gpu_worker.kv_transfer.base import BACKENDS, KVPuller, TransferError, select_backend

__all__ = ["BACKENDS", "KVPuller", "TransferError", "make_puller", "select_backend"]


def make_puller(backend: str) -> KVPuller:
    if backend == "shm":
        from services.gpu_worker.kv_transfer.shm import ShmPuller
        return ShmPuller()
    if backend == "cuda_ipc":
        from services.gpu_worker.kv_transfer.cuda_ipc import CudaIpcPuller
        return CudaIpcPuller()
    if backend == "stream":
        from services.gpu_worker.kv_transfer.stream import StreamPuller
        return StreamPuller()
    raise ValueError(f"unknown kv transfer backend {backend!r}")

