"""Spawning tensor-parallel ranks as processes (torch.multiprocessing, spawn): all of them for tests and
benchmarks (launch), or ranks 1..N-1 beside an in-process rank 0 for the worker service (spawn_followers).

Every rank first joins the TP group (parallel/state.py) at a rendezvous: a file:// in a fresh temporary
folder unless an init_method is given, so no port is picked that someone else could take first. launch()'s
ranks report over one pipe each, as MessagePack: rank 0's value, or an error by its class and message.
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
import torch.multiprocessing as mp

from services.gpu_worker.parallel.state import cpu_threads_per_rank, destroy_tensor_parallel, init_tensor_parallel

T = TypeVar("T")
POLL_S = 0.2
AFTER_ERROR_S = 5.0  # once a rank failed, how long the others get to report (theirs usually follow from it)


class RankError(msgspec.Struct, frozen=True):
    """An exception raised in a rank, by value: rebuilt in the parent as its class when that can be found."""

    module: str
    name: str
    message: str
    note: str  # the rank and its traceback


class RankReport(msgspec.Struct, frozen=True):
    rank: int
    value: Any = None  # rank 0's result (MessagePack types: tensors as nested lists, tuples as lists)
    error: RankError | None = None


_REPORT_DECODER = msgspec.msgpack.Decoder(RankReport)


def launch(tp_size: int, fn: Callable[..., T], *args: Any, device_type: str = "cpu",
           init_method: str | None = None, timeout_s: float = 600.0) -> T:
    """Run fn(*args) in tp_size spawned processes, each one rank of a TP group; return rank 0's result.

    fn must be importable by name (a module-level function) and return MessagePack types. A rank's exception
    is raised here, the first to arrive (usually the cause; the others' errors follow from it), with the
    rank and its traceback as a note. CPU ranks split the machine's cores between them.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, not {tp_size}")
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(tp_size)]  # (parent's reader, rank's writer)
    with rendezvous(init_method) as method:
        processes = [ctx.Process(target=_rank_main, args=(rank, tp_size, method, device_type, fn, args, writer),
                                 name=f"tp-rank-{rank}", daemon=True) for rank, (_, writer) in enumerate(pipes)]
        for process in processes:
            process.start()
        for _, writer in pipes:
            writer.close()  # NOTE: the ranks hold theirs; a rank that dies unreported then reads as EOF
        reports: list[RankReport] = []
        try:
            _collect(processes, [reader for reader, _ in pipes], time.monotonic() + timeout_s, reports)
        finally:
            _stop(processes, grace_s=10.0 if len(reports) == tp_size else 1.0)
            for reader, _ in pipes:
                reader.close()
    errors = [report for report in reports if report.error is not None]
    if errors:
        raise _rebuild(errors[0])
    return next(report.value for report in reports if report.rank == 0)


@dataclass
class Followers:
    """Ranks 1..N-1 running beside rank 0 (the worker service's own process)."""

    processes: list[mp.Process]
    init_method: str
    _rendezvous: contextlib.ExitStack = field(repr=False)

    def join(self, timeout_s: float) -> bool:
        """Wait for the followers to end (after rank 0's stop); stop stragglers. True if all ended in time."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        is_clean = all(p.exitcode == 0 for p in self.processes)
        _stop(self.processes, grace_s=1.0)
        self._rendezvous.close()
        return is_clean


def spawn_followers(tp_size: int, fn: Callable[..., Any], *args: Any, device_type: str = "cpu",
                    init_method: str | None = None) -> Followers:
    """Start ranks 1..tp_size-1 running fn(*args) in their TP group; the caller then joins as rank 0."""
    ctx = mp.get_context("spawn")
    stack = contextlib.ExitStack()
    method = stack.enter_context(rendezvous(init_method))
    processes = [ctx.Process(target=_rank_main, args=(rank, tp_size, method, device_type, fn, args, None),
                             name=f"tp-rank-{rank}", daemon=True) for rank in range(1, tp_size)]
    for process in processes:
        process.start()
    return Followers(processes, method, stack)


@contextlib.contextmanager
def rendezvous(init_method: str | None) -> Iterator[str]:
    """init_method as given, or a file:// rendezvous in a temporary folder removed afterwards."""
    if init_method is not None:
        yield init_method
        return
    folder = Path(tempfile.mkdtemp(prefix="radixserve-tp-"))
    try:
        yield f"file://{folder / 'rendezvous'}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _rank_main(rank: int, size: int, init_method: str, device_type: str, fn: Callable[..., Any],
               args: tuple[Any, ...], writer: Connection | None) -> None:
    """One spawned rank: join the group, run fn, report rank 0's value or the error when it has a pipe."""
    try:
        if device_type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(size))
        init_tensor_parallel(rank, size, init_method, device_type)
        value = fn(*args)
        if writer is not None:
            writer.send_bytes(msgspec.msgpack.encode(RankReport(rank, value if rank == 0 else None)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        if writer is None:
            raise
        note = f"raised in tensor-parallel rank {rank}:\n{''.join(traceback.format_exception(exc))}"
        error = RankError(type(exc).__module__, type(exc).__qualname__, str(exc), note)
        writer.send_bytes(msgspec.msgpack.encode(RankReport(rank, error=error)))
    finally:
        destroy_tensor_parallel()


def _rebuild(report: RankReport) -> BaseException:
    """The rank's exception as its own class when importable and built from a message, else a RuntimeError."""
    error = report.error
    assert error is not None
    cls: Any = None
    with contextlib.suppress(Exception):
        module = builtins if error.module == "builtins" else importlib.import_module(error.module)
        cls = getattr(module, error.name)
    exc: BaseException
    try:
        exc = cls(error.message) if isinstance(cls, type) and issubclass(cls, Exception) else None
    except Exception:  # noqa: BLE001 - a class that takes other arguments
        exc = None
    if exc is None:
        exc = RuntimeError(f"{error.name}: {error.message}" if error.name else error.message)
    if error.note:
        exc.add_note(error.note)
    return exc


def _collect(processes: list[mp.Process], readers: list[Connection], deadline: float,
             reports: list[RankReport]) -> None:
    """Append every rank's report in arrival order; a rank that died without reporting, or missing reports at
    the deadline (a few seconds after the first error), end the wait with an error report."""
    pending = dict(zip(readers, range(len(readers))))
    while pending:
        for reader in wait(list(pending), timeout=POLL_S):
            rank = pending.pop(reader)
            try:
                report = _REPORT_DECODER.decode(reader.recv_bytes())
            except (EOFError, OSError):
                code = processes[rank].exitcode
                reports.append(RankReport(rank, error=RankError("", "", f"tensor-parallel rank {rank} died (exit "
                                                                        f"code {code}) without reporting", "")))
                return
            reports.append(report)
            if report.error is not None:
                deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
        if pending and time.monotonic() > deadline:
            missing = sorted(pending.values())
            reports.append(RankReport(missing[0], error=RankError(
                "builtins", "TimeoutError", f"tensor-parallel ranks {missing} did not finish in time", "")))
            return


def _stop(processes: list[mp.Process], grace_s: float) -> None:
    """Join processes for up to grace_s, then terminate (and reap) those still running."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(5.0)
