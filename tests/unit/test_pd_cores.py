"""PD pure cores: the scheduler's pairing policy, the in-flight table's two legs, the prefill side's lease
table, and transfer-backend selection: exact decisions, hypothesis against simple models."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gpu_worker.kv_transfer.base import TransferError, select_backend
from services.gpu_worker.kv_transfer.cuda_ipc import handle_from_share, share_args
from services.gpu_worker.kv_transfer.stream import pages_per_chunk
from services.gpu_worker.lease_table import Lease, LeaseTable
from services.scheduler.inflight import InFlight, InFlightTable
from services.scheduler.pairing import PairReason, make_pairing
from services.scheduler.policy import Candidate, RouteRequest, make_policy
from services.scheduler.registry import WorkerInfo
from shared.messages import CudaIpcHandle, KVSource, WorkerLoad

TIMEOUT_S = 3.0
NOW_S = 100.0


def info(worker_id: str, role: str, running: int = 0, last_seen_s: float = NOW_S) -> WorkerInfo:
    return WorkerInfo(worker_id, "i1", f"ipc://{worker_id}", "m", role, 16,
                      WorkerLoad(running, 0, 0, 100, 100), last_seen_s)


def route(num_prompt_tokens: int, cached: dict[str, int] | None = None) -> RouteRequest:
    return RouteRequest("r", num_prompt_tokens, num_prompt_tokens // 16, NOW_S, num_cached_blocks=cached or {})


def pairing(mode: str, min_prefill_tokens: int = 256):
    local = make_policy("cache_aware", TIMEOUT_S, roles=("mixed", "decode"))
    return make_pairing(mode, local, TIMEOUT_S, min_prefill_tokens=min_prefill_tokens)


def legs(result) -> tuple[str | None, str, PairReason] | None:
    if result is None:
        return None
    return (result.prefill.worker_id if result.prefill else None, result.decode.worker_id, result.reason)


PD_WORKERS = [Candidate(info("p0", "prefill")), Candidate(info("p1", "prefill", running=3)),
              Candidate(info("d0", "decode", running=2)), Candidate(info("d1", "decode"))]


# --- pairing --------------------------------------------------------------------------------------------

def test_always_splits_onto_the_cheapest_prefill_and_decode_workers() -> None:
    assert legs(pairing("always").choose(PD_WORKERS, route(64))) == ("p0", "d1", PairReason.PD)


def test_pairing_is_cache_aware_on_both_sides() -> None:
    cached = {"p1": 60, "d0": 60}  # 960 of 1024 prompt tokens on p1 and d0: worth more than their load
    assert legs(pairing("always").choose(PD_WORKERS, route(1024, cached))) == ("p1", "d0", PairReason.PD)


def test_auto_keeps_short_and_mostly_cached_prompts_local() -> None:
    policy = pairing("auto", min_prefill_tokens=256)
    assert legs(policy.choose(PD_WORKERS, route(255))) == (None, "d1", PairReason.SHORT)
    assert legs(policy.choose(PD_WORKERS, route(256))) == ("p0", "d1", PairReason.PD)
    cached = {"d0": 50}  # d0 would prefill 1024 - 800 = 224 tokens itself
    assert legs(policy.choose(PD_WORKERS, route(1024, cached))) == (None, "d0", PairReason.SHORT)
    assert legs(policy.choose(PD_WORKERS, route(1024, {"d0": 40}))) == ("p0", "d0", PairReason.PD)


def test_never_multi_sample_and_missing_roles_run_locally() -> None:
    assert legs(pairing("never").choose(PD_WORKERS, route(4096))) == (None, "d1", PairReason.NEVER)
    assert legs(pairing("always").choose(PD_WORKERS, route(4096), num_samples=2)) == (
        None, "d1", PairReason.MULTI_SAMPLE)
    mixed = [Candidate(info("m0", "mixed")), Candidate(info("d0", "decode", running=1))]
    assert legs(pairing("always").choose(mixed, route(4096))) == (None, "m0", PairReason.NO_PREFILL_WORKER)
    prefill_only = [Candidate(info("p0", "prefill"))]
    assert pairing("always").choose(prefill_only, route(4096)) is None
    dead_prefill = [Candidate(info("p0", "prefill", last_seen_s=NOW_S - 10)), Candidate(info("d0", "decode"))]
    assert legs(pairing("always").choose(dead_prefill, route(4096))) == (None, "d0", PairReason.NO_PREFILL_WORKER)


def test_unknown_pd_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        pairing("sometimes")


roles = st.sampled_from(["mixed", "prefill", "decode"])


@settings(max_examples=200)
@given(workers=st.lists(st.tuples(roles, st.integers(0, 6), st.booleans()), max_size=6),
       mode=st.sampled_from(["auto", "always", "never"]), num_tokens=st.integers(1, 2048),
       num_samples=st.integers(1, 2))
def test_pairing_property_roles_are_respected(workers, mode: str, num_tokens: int, num_samples: int) -> None:
    candidates = [Candidate(info(f"w{i}", role, running, NOW_S if alive else NOW_S - 10))
                  for i, (role, running, alive) in enumerate(workers)]
    result = pairing(mode).choose(candidates, route(num_tokens), num_samples)
    alive = {c.worker_id: c.worker.role for c in candidates if c.worker.last_seen_s == NOW_S}
    can_run_whole = any(r in ("mixed", "decode") for r in alive.values())
    assert (result is None) == (not can_run_whole)
    if result is None:
        return
    assert alive[result.decode.worker_id] in ("mixed", "decode")
    if result.prefill is not None:
        assert alive[result.prefill.worker_id] == "prefill"
        assert mode != "never" and num_samples == 1
        assert mode == "always" or num_tokens >= 256


# --- in-flight legs -------------------------------------------------------------------------------------

def test_inflight_indexes_both_legs_until_the_handoff() -> None:
    table = InFlightTable()
    table.add("r1", "d0", "ipc://t", prefill_worker_id="p0")
    table.add("r2", "d0", "ipc://t")
    assert (table.count("p0"), table.count("d0")) == (1, 2)
    assert table.close_prefill("r1") == InFlight("r1", "d0", "ipc://t")
    assert (table.count("p0"), table.count("d0")) == (0, 2)
    table.add("r3", "d1", "ipc://t", prefill_worker_id="p0")
    assert table.pop_worker("p0") == [InFlight("r3", "d1", "ipc://t", "p0")]
    assert table.count("d1") == 0 and len(table) == 2
    table.check_invariants()


@given(ops=st.lists(st.tuples(st.sampled_from(["add", "pd", "pop", "close", "drop"]), st.sampled_from("abc"),
                              st.sampled_from(["p0", "d0", "d1"])), max_size=40))
def test_inflight_with_legs_matches_a_dict_model(ops) -> None:
    table, model = InFlightTable(), {}
    for op, request_id, worker in ops:
        if op == "add":
            table.add(request_id, worker, "ipc://t")
            model[request_id] = (worker, None)
        elif op == "pd":
            table.add(request_id, "d0", "ipc://t", prefill_worker_id="p0")
            model[request_id] = ("d0", "p0")
        elif op == "pop":
            assert (table.pop(request_id) is None) == (model.pop(request_id, None) is None)
        elif op == "close" and request_id in model:
            table.close_prefill(request_id)
            model[request_id] = (model[request_id][0], None)
        elif op == "drop":
            dropped = {e.request_id for e in table.pop_worker(worker)}
            assert dropped == {r for r, legs_ in model.items() if worker in legs_}
            model = {r: v for r, v in model.items() if r not in dropped}
        table.check_invariants()
        for w in ("p0", "d0", "d1"):
            assert table.count(w) == sum(w in v for v in model.values())


# --- leases ---------------------------------------------------------------------------------------------

def test_lease_table_ends_each_lease_exactly_once() -> None:
    table = LeaseTable()
    table.grant(Lease("l1", "r1", (3, 4), expires_s=10.0))
    table.grant(Lease("l2", "r2", (5,), expires_s=5.0))
    with pytest.raises(ValueError):
        table.grant(Lease("l3", "r1", (6,), expires_s=9.0))
    assert (len(table), table.num_pages, table.next_expiry_s()) == (2, 3, 5.0)
    assert table.is_valid("l2", 4.9) and not table.is_valid("l2", 5.0)
    assert table.expire(4.9) == []
    assert [lease.lease_id for lease in table.expire(5.0)] == ["l2"]
    assert table.release("l2") is None
    assert table.release_request("r1").page_ids == (3, 4)
    assert table.expire(100.0) == [] and table.next_expiry_s() is None
    table.check_invariants()


@given(ops=st.lists(st.tuples(st.sampled_from(["grant", "release", "expire"]), st.integers(0, 5),
                              st.floats(0, 20)), max_size=40))
def test_lease_table_matches_a_dict_model(ops) -> None:
    table, model, now = LeaseTable(), {}, 0.0
    for n, (op, key, t) in enumerate(ops):
        if op == "grant" and f"r{key}" not in {v[0] for v in model.values()}:
            table.grant(Lease(f"l{n}", f"r{key}", (key,), expires_s=now + t))
            model[f"l{n}"] = (f"r{key}", now + t)
        elif op == "release":
            lease_id = next(iter(model), None)
            if lease_id is not None:
                assert table.release(lease_id).lease_id == lease_id
                del model[lease_id]
        elif op == "expire":
            now += t
            expired = {lease.lease_id for lease in table.expire(now)}
            assert expired == {k for k, (_, e) in model.items() if e <= now}
            model = {k: v for k, v in model.items() if k not in expired}
        table.check_invariants()
        assert len(table) == len(model)


# --- backend selection ----------------------------------------------------------------------------------

def source(host_id: str = "h1", device_type: str = "cpu", shm: bool = True, cuda: bool = False,
           stream: bool = True) -> KVSource:
    handle = CudaIpcHandle(0, b"h", 64, 0, b"r", 0, b"e", True) if cuda else None
    return KVSource(host_id, device_type, 2, 8, 4, 2, 16, "float32", stream_addr="tcp://h1:5571" if stream else "",
                    shm_name="kv" if shm else "", cuda_k=handle, cuda_v=handle)


def test_backend_is_chosen_by_placement() -> None:
    assert select_backend(source(), "h1", "cpu") == "shm"
    assert select_backend(source(), "h2", "cpu") == "stream"
    assert select_backend(source(device_type="cuda", shm=False, cuda=True), "h1", "cuda") == "cuda_ipc"
    assert select_backend(source(device_type="cuda", shm=False, cuda=True), "h2", "cuda") == "stream"
    assert select_backend(source(device_type="cuda", shm=False, cuda=True), "h1", "cpu") == "stream"


def test_backend_override_is_honoured_or_refused() -> None:
    assert select_backend(source(), "h1", "cpu", "stream") == "stream"
    with pytest.raises(TransferError):
        select_backend(source(), "h2", "cpu", "shm")
    with pytest.raises(TransferError):
        select_backend(source(shm=False, stream=False), "h2", "cpu")
    with pytest.raises(ValueError):
        select_backend(source(), "h1", "cpu", "rdma")


def test_cuda_ipc_handles_round_trip_through_the_wire_form() -> None:
    shared = (0, b"\x01" * 64, 1 << 30, 512, b"\x02" * 16, 8, b"\x03" * 64, True)
    handle = handle_from_share(shared)
    assert share_args(handle) == shared
    assert handle.size_bytes == 1 << 30 and handle.event_sync_required is True


def test_stream_chunks_hold_whole_pages() -> None:
    assert pages_per_chunk(1 << 20, 8 << 20) == 8
    assert pages_per_chunk(9 << 20, 8 << 20) == 1
    assert pages_per_chunk(3, 10) == 3
