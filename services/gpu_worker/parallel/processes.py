"""Spawning tensor-parallel ranks as processes (torch.multiprocessing, spawn): all of them for tests and
benchmarks (launch), or ranks 1..N-1 beside an in-process rank 0 for the worker service (spawn_followers).

Every rank first joins the TP group (parallel/state.py) at a rendezvous: a file:// in a fresh temporary
folder unless an init_method is given, so no port is picked that someone else could take first.
"""
from __future__ import annotations

import contextlib
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from services.gpu_worker.parallel.state import cpu_threads_per_rank, destroy_tensor_parallel, init_tensor_parallel

T = TypeVar("T")
POLL_S = 0.2
AFTER_ERROR_S = 5.0  # once a rank failed, how long the others get to report (theirs usually follow from it)


def launch(tp_size: int, fn: Callable[..., T], *args: Any, device_type: str = "cpu",
           init_method: str | None = None, timeout_s: float = 600.0) -> T:
    """Run fn(*args) in tp_size spawned processes, each one rank of a TP group; return rank 0's result.

    fn must be importable by name (a module-level function) and its result picklable. A rank's exception
    is raised here, the first to arrive (usually the cause; the others' errors follow from it), with the
    rank and its traceback as notes. CPU ranks split the machine's cores between them.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, not {tp_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with rendezvous(init_method) as method:
        processes = [ctx.Process(target=_rank_main, args=(rank, tp_size, method, device_type, fn, args, results),
                                 name=f"tp-rank-{rank}", daemon=True) for rank in range(tp_size)]
        for process in processes:
            process.start()
        outcomes: list[tuple[int, Any, Any]] = []
        try:
            _collect(processes, results, time.monotonic() + timeout_s, outcomes)
        finally:
            _stop(processes, grace_s=10.0 if len(outcomes) == tp_size else 1.0)
    errors = [error for _, error, _ in outcomes if error is not None]
    if errors:
        raise errors[0]
    return pickle.loads(next(value for rank, _, value in outcomes if rank == 0))


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
               args: tuple[Any, ...], results: Any | None) -> None:
    """One spawned rank: join the group, run fn, report (rank, error, rank 0's value) when results is a queue."""
    try:
        if device_type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(size))
        init_tensor_parallel(rank, size, init_method, device_type)
        value = fn(*args)
        if results is not None:  # NOTE: pickled by value here, not as shared memory this process must outlive
            results.put((rank, None, pickle.dumps(value if rank == 0 else None)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        if results is None:
            raise
        results.put((rank, _portable(exc, rank), None))
    finally:
        destroy_tensor_parallel()


def _portable(exc: BaseException, rank: int) -> BaseException:
    """exc with its rank and traceback as a note, or a RuntimeError naming it when exc does not pickle."""
    note = f"raised in tensor-parallel rank {rank}:\n{''.join(traceback.format_exception(exc))}"
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any pickling failure: send a description instead
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    exc.__traceback__ = None
    exc.add_note(note)
    return exc


def _collect(processes: list[mp.Process], results: Any, deadline: float,
             outcomes: list[tuple[int, Any, Any]]) -> None:
    """Append every rank's (rank, error, value) in arrival order; a rank that died without reporting, or
    missing reports at the deadline (a few seconds after the first error), end the wait with an error."""
    while len(outcomes) < len(processes):
        try:
            outcome = results.get(timeout=POLL_S)
            outcomes.append(outcome)
            if outcome[1] is not None:
                deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
            continue
        except queue.Empty:
            pass
        reported = {rank for rank, _, _ in outcomes}
        dead = [rank for rank, p in enumerate(processes) if p.exitcode is not None and rank not in reported]
        if dead:
            with contextlib.suppress(queue.Empty):  # it may have reported just before exiting
                outcomes.append(results.get(timeout=1.0))
                continue
            rank = dead[0]
            outcomes.append((rank, RuntimeError(f"tensor-parallel rank {rank} died (exit code "
                                                f"{processes[rank].exitcode}) without reporting"), None))
            return
        if time.monotonic() > deadline:
            missing = [rank for rank in range(len(processes)) if rank not in reported]
            outcomes.append((missing[0], TimeoutError(f"tensor-parallel ranks {missing} did not finish in time"),
                             None))
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
