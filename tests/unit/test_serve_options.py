"""`radixserve serve` takes its services' flags from their config dataclasses, without importing torch."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve import serve
from services.gpu_worker.config import WorkerConfig
from services.scheduler.config import SchedulerConfig
from shared.config import load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    return parser


def _metadata(cls: type, name: str) -> dict:
    return dict(next(f for f in dataclasses.fields(cls) if f.name == name).metadata)


def test_serve_and_the_configs_import_no_torch() -> None:
    code = ("import sys, radixserve.serve, services.gpu_worker.config, services.scheduler.config; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("cls, name", [(WorkerConfig, "kv_cache_dtype"), (WorkerConfig, "kv_transfer"),
                                       (SchedulerConfig, "routing"), (SchedulerConfig, "pd_policy")])
def test_serve_choices_and_help_are_the_config_fields(cls: type, name: str) -> None:
    action = next(a for a in _parser()._actions if a.dest == name)

    assert (action.choices, action.help) == (_metadata(cls, name)["choices"], _metadata(cls, name)["help"])
    assert action.default == getattr(cls(), name)


def test_children_get_the_serve_flags_and_their_configs_accept_them(tmp_path: Path) -> None:
    args = _parser().parse_args(["--kv-cache-dtype", "fp8", "--routing", "least_load", "--pd-policy", "never",
                                 "--gemv-max-tokens", "0", "--max-num-seqs", "32", "--redis-url", "redis://x:1"])
    children = {c.name: c.argv for c in serve.build_suite(args, tmp_path).children}

    worker = load_config(WorkerConfig, children["worker0"][1:])
    scheduler = load_config(SchedulerConfig, children["scheduler"][1:])
    assert (worker.kv_cache_dtype, worker.gemv_max_tokens, worker.max_num_seqs) == ("fp8", "0", 32)
    assert (worker.max_num_batched_tokens, worker.num_pages, worker.model) == (0, 0, "bundled")
    assert (scheduler.routing, scheduler.pd_policy, scheduler.pd_min_prefill_tokens) == ("least_load", "never", 256)


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["--routing", "random"], "argument --routing: invalid choice: 'random'"),
    (["--gemv-max-tokens", "17"], "argument --gemv-max-tokens: gemv_max_tokens must be auto or 0 to 16, not '17'"),
])
def test_serve_refuses_what_the_service_refuses(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)

    assert message in capsys.readouterr().err


def test_a_config_checks_the_choices_of_its_metadata() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8, not 'int4'"):
        WorkerConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="routing must be one of cache_aware, least_load, round_robin, not 'x'"):
        SchedulerConfig(routing="x")
    with pytest.raises(ValueError, match="kv_transfer must be one of auto, shm, cuda_ipc, stream, not 'x'"):
        WorkerConfig(kv_transfer="x")


def test_a_dead_child_restarts_with_backoff_that_resets_after_a_stable_run() -> None:
    child = serve.Child("worker0", ["services.gpu_worker"])
    child.started_s = 100.0
    delays = []
    for _ in range(9):  # crashing at once each time: the delay doubles up to the cap
        delays.append(child.schedule_restart(child.started_s + 1.0))
        child.started_s = child.restart_at_s
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert child.num_restarts == 9
    assert child.schedule_restart(child.started_s + serve.STABLE_S) == serve.RESTART_INITIAL_S  # ran long: reset
