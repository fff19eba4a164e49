"""This process's tensor-parallel group: its rank, the size, and the two process groups the ranks talk over.

    device group   all_reduce of activations after o_proj and down_proj (NCCL on CUDA, gloo on the CPU)
    control group  gloo: rank 0's per-step commands as MessagePack bytes, and small agreements (the page count)

One TP group per process, spanning the whole torch.distributed world (one host, rank r on cuda:r). It is set
by init_tensor_parallel() before the Engine is built, and read by the Engine only when its config's
tensor_parallel_size > 1: a single-rank engine never imports this module.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Followers wait in a control broadcast for as long as rank 0 has no work: the control group must not time out
# on an idle server. (A rank that dies closes its sockets, which ends the peers' waits with an error.)
CONTROL_TIMEOUT = timedelta(days=30)
DEVICE_TIMEOUT = timedelta(minutes=10)  # a collective inside a step: every rank is running the same step
CONTROL_BUFFER_BYTES = 16 << 10  # one broadcast carries a payload up to this size; larger ones take a second
_HEADER = struct.Struct("<Q")  # the payload's length, in front of it


@dataclass(frozen=True, eq=False)
class TensorParallelGroup:
    rank: int
    size: int
    device_type: str  # "cuda" or "cpu"
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup

    @property
    def is_leader(self) -> bool:
        """Rank 0 owns the request stream and returns the outputs."""
        return self.rank == 0

    def local_device(self, device: torch.device) -> torch.device:
        """This rank's device: cuda:rank on CUDA (one host), the CPU as it is."""
        if device.type == "cuda":
            return torch.device("cuda", self.rank)
        return device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks in place (the row-parallel projections' partial products); returns x."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV pages: each rank sizes its pool from its own memory)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def broadcast_bytes(self, payload: bytes = b"") -> bytes:
        """Rank 0's payload on every rank (the others pass nothing and get it back).

        Usually one gloo broadcast of a fixed buffer [length ‖ payload]; a payload larger than the buffer
        follows in a second broadcast of its own size.
        """
        buffer = torch.zeros(CONTROL_BUFFER_BYTES, dtype=torch.uint8)  # [N] uint8
        fits = _HEADER.size + len(payload) <= CONTROL_BUFFER_BYTES
        if self.is_leader:
            buffer[: _HEADER.size] = torch.frombuffer(bytearray(_HEADER.pack(len(payload))), dtype=torch.uint8)
            if fits and payload:
                buffer[_HEADER.size: _HEADER.size + len(payload)] = torch.frombuffer(bytearray(payload),
                                                                                   dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.control_group)
        if self.is_leader:
            if not fits:
                dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0,
                               group=self.control_group)
            return payload
        (length,) = _HEADER.unpack(buffer[: _HEADER.size].numpy().tobytes())
        if _HEADER.size + length <= CONTROL_BUFFER_BYTES:
            return buffer[_HEADER.size: _HEADER.size + length].numpy().tobytes()
        large = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(large, src=0, group=self.control_group)
        return large.numpy().tobytes()


_group: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, size: int, init_method: str, device_type: str = "cpu") -> TensorParallelGroup:
    """Join the TP group as `rank` of `size` (rendezvous at init_method: "tcp://host:port" or "file://path").

    On CUDA, rank r takes cuda:r and the device group runs NCCL; on the CPU both groups are gloo.
    """
    global _group
    if _group is not None:
        raise RuntimeError(f"this process is already rank {_group.rank} of a tensor-parallel group")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of size {size}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"tensor parallelism runs on cuda or cpu, not {device_type!r}")
    if device_type == "cuda":
        if torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        torch.cuda.set_device(rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=DEVICE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, size, device_type, dist.group.WORLD, control)
    return _group


def current_group(size: int) -> TensorParallelGroup:
    """The group init_tensor_parallel() set up in this process; it must have `size` ranks."""
    if _group is None:
        raise RuntimeError(f"tensor_parallel_size={size}, but this process joined no tensor-parallel group: build "
                           "the Engine inside a rank (parallel.launch(), parallel.start_engine())")
    if _group.size != size:
        raise ValueError(f"tensor_parallel_size={size}, but this process's group has {_group.size} ranks")
    return _group


def destroy_tensor_parallel() -> None:
    """Leave the group (if any) and tear the process groups down."""
    global _group
    _group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_threads_per_rank(size: int) -> int:
    """Intra-op threads for one of `size` CPU ranks on this machine (no oversubscription)."""
    return max(1, (os.cpu_count() or 1) // size)
