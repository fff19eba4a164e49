"""A draining worker (its heartbeat says is_draining) gets no new request from any routing policy, and the
worker's health file holds its state, replaced whole."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.gpu_worker.service import is_idle, write_health_file
from services.scheduler.policy import POLICIES, Candidate, CostWeights, RouteRequest, make_policy
from services.scheduler.registry import HeartbeatKind, Registry
from shared.messages import WorkerHeartbeat, WorkerLoad

NOW_S = 100.0


def heartbeat(worker_id: str, is_draining: bool = False, running: int = 0) -> WorkerHeartbeat:
    load = WorkerLoad(num_running=running, num_waiting=0, num_queued_tokens=0, num_free_pages=100,
                      num_total_pages=100)
    return WorkerHeartbeat(worker_id, "i1", "tcp://10.0.0.1:5570", "m", "mixed", 16, load, is_draining=is_draining)


@pytest.mark.parametrize("policy_name", POLICIES)
def test_no_policy_routes_to_a_draining_worker(policy_name: str) -> None:
    registry = Registry()
    registry.on_heartbeat(heartbeat("a", running=5), NOW_S)
    registry.on_heartbeat(heartbeat("b"), NOW_S)
    assert registry.on_heartbeat(heartbeat("b", is_draining=True), NOW_S)[0] is HeartbeatKind.UPDATED
    policy = make_policy(policy_name, 3.0, CostWeights())
    request = RouteRequest("r", num_prompt_tokens=35, num_blocks=2, now_s=NOW_S, model_id=None,
                           num_cached_blocks={"b": 2})
    candidates = [Candidate(w) for w in registry.workers()]
    assert [policy.choose(candidates, request).worker_id for _ in range(3)] == ["a", "a", "a"]
    registry.on_heartbeat(heartbeat("a", is_draining=True), NOW_S)
    assert policy.choose([Candidate(w) for w in registry.workers()], request) is None


def test_worker_info_keeps_the_draining_flag_of_the_latest_heartbeat() -> None:
    registry = Registry()
    registry.on_heartbeat(heartbeat("a", is_draining=True), NOW_S)
    assert registry.get("a").is_draining
    registry.on_heartbeat(heartbeat("a"), NOW_S + 1)
    assert not registry.get("a").is_draining


def test_idle_means_nothing_running_waiting_or_leased() -> None:
    load = heartbeat("a").load
    assert is_idle(load)
    for field_name in ("num_running", "num_waiting", "num_leased_pages"):
        busy = WorkerLoad(**{**{f: getattr(load, f) for f in load.__struct_fields__}, field_name: 1})
        assert not is_idle(busy), field_name


def test_health_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "health"
    write_health_file(str(path), "serving")
    write_health_file(str(path), "draining")
    assert path.read_text() == "draining"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["health"]
