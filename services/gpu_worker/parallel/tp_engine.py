"""SPMD lockstep of a tensor-parallel engine: rank 0 owns the request stream, every rank runs the same steps.

    rank 0: LockstepEngine                                 ranks 1..N-1: follow()
    add_request / abort / release_finished:
      run at once on rank 0, recorded as ops
    step():  broadcast StepPacket ──────────────────────▶  check rank 0's previous outputs against their own,
             (ops, now, seed, digest of the last outputs)    apply the ops
             pin `now`, seed the RNG, Engine.step()  ◀── all_reduce per layer ──▶  the same Engine.step()
             return the outputs                              (kept only as the next check's digest)
    shutdown(): broadcast a stop packet ────────────────▶  return

Why every rank plans and samples the same: the batch policy is a pure function of the request stream and the
clock; every rank applies the same ops in the same order between the same steps, and the one clock value it
reads is rank 0's (the policy passes `now` on to the radix cache only, as LRU stamps that order evictions;
LockstepRadixCache replaces each rank's own time.monotonic() there with the broadcast value). Dicts keep
insertion order, the sets are of ints and only tested for membership, and eviction ties break on node ids
that every rank numbers alike. The hidden states after each all_reduce are the same bits on every rank, the
final norm and LM head are replicated, so the logits are too; seeded requests sample from their own
generators and unseeded ones from the global RNG, which every rank seeds with the step's broadcast seed.
A follower that still sees different outputs stops with TensorParallelDivergence before its next step,
rather than enter collectives that no longer match.

Not supported under TP: PD roles (prefill-only requests, KV imports and exports).
"""
from __future__ import annotations

import random
import signal
import time
import zlib

import msgspec
import torch

from services.gpu_worker.engine import Engine, RequestResult
from services.gpu_worker.engine_config import EngineConfig
from services.gpu_worker.parallel.processes import Followers, spawn_followers
from services.gpu_worker.parallel.state import destroy_tensor_parallel, init_tensor_parallel
from services.gpu_worker.parallel.lockstep_cache import LockstepRadixCache
from services.gpu_worker.request import SamplingParams, TokenOutput

SHUTDOWN_TIMEOUT_S = 30.0


class TensorParallelDivergence(RuntimeError):
    """A follower's step outputs differ from rank 0's: the ranks no longer run the same batch."""


class AddOp(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortOp(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    now: float  # rank 0's clock when it aborted


class ReleaseOp(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class FlushOp(msgspec.Struct, frozen=True, tag=True):
    """Engine.flush(): read the launched step's tokens (overlap mode) before the next step schedules."""


Op = AddOp | AbortOp | ReleaseOp | FlushOp


class StepPacket(msgspec.Struct, frozen=True):
    """Rank 0 → followers before each step (MessagePack on the control group): what changed since the last
    one, and the step's clock and seed."""

    ops: list[Op]
    previous_digest: int  # digest of rank 0's outputs of the previous step
    now: float = 0.0
    seed: int = 0
    is_stop: bool = False  # apply the ops, then leave the loop (no step)


_PACKET_DECODER = msgspec.msgpack.Decoder(StepPacket)


def outputs_digest(outputs: list[TokenOutput]) -> int:
    """A checksum of one step's outputs (ids, sample index, tokens, whether it ended), equal across ranks."""
    return zlib.crc32(msgspec.msgpack.encode([(o.request_id, o.index, o.token_ids, o.finish_reason is not None)
                                              for o in outputs]))


def _apply(engine: Engine, op: Op) -> None:
    if isinstance(op, AddOp):
        engine.add_request(op.request_id, op.prompt_token_ids, op.params)
    elif isinstance(op, AbortOp):
        engine.cache.pin_clock(op.now)
        engine.abort(op.request_id)
    elif isinstance(op, FlushOp):
        engine.flush()
    else:
        engine.release_finished(op.request_id)


def _run_step(engine: Engine, packet: StepPacket) -> list[TokenOutput]:
    engine.cache.pin_clock(packet.now)
    torch.manual_seed(packet.seed)  # the global RNG: unseeded sampled rows draw the same noise on every rank
    return engine.step()


class LockstepEngine:
    """Rank 0's engine under tensor parallelism: Engine's request calls, mirrored to the followers.

    add_request, abort and release_finished run on rank 0 at once (so errors reach the caller as from
    Engine) and travel to the followers with the next step. Everything else is read from rank 0's Engine
    as it is (config, stats(), policy, cache, model_config, tokenizer, ...). shutdown() ends the followers.
    A step that raises leaves the ranks out of step (some may wait in a collective): the engine refuses
    every later call, and the worker has to be restarted.
    """

    def __init__(self, engine: Engine, followers: Followers | None = None) -> None:
        if engine.tp is None or not engine.tp.is_leader:
            raise ValueError("LockstepEngine wraps rank 0's Engine of a tensor-parallel group")
        self.engine = engine
        self.tp = engine.tp
        self._followers = followers
        self._ops: list[Op] = []
        self._previous_digest = outputs_digest([])
        self._seeds = random.SystemRandom()
        self._is_stopped = False
        self._failure: BaseException | None = None  # a step that raised: the group is out of step for good

    def __getattr__(self, name: str):
        if name == "engine":  # not set yet (a half-built object): no recursion through the line below
            raise AttributeError(name)
        return getattr(self.engine, name)  # reads only: every state change goes through the methods below

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    is_prefill_only: bool = False, arrival_s: float | None = None) -> None:
        if is_prefill_only:
            raise ValueError("prefill-only (PD) requests are not supported with tensor parallelism")
        self._check_running()
        self.engine.add_request(request_id, prompt_token_ids, params, arrival_s=arrival_s)  # metrics: rank 0's only
        self._ops.append(AddOp(request_id, list(prompt_token_ids), params))

    def abort(self, request_id: str) -> list[TokenOutput]:
        self._check_running()
        now = time.monotonic()
        self.engine.cache.pin_clock(now)
        outputs = self.engine.abort(request_id)
        self._ops.append(AbortOp(request_id, now))
        return outputs

    def release_finished(self, request_id: str) -> None:
        self._check_running()
        self.engine.release_finished(request_id)
        self._ops.append(ReleaseOp(request_id))

    def flush(self) -> list[TokenOutput]:
        """Engine.flush() here now, on the followers before the next step (it has no collectives)."""
        self._check_running()
        outputs = self.engine.flush()
        self._ops.append(FlushOp())
        return outputs

    def step(self) -> list[TokenOutput]:
        """One step on every rank (the followers get this step's ops, clock and seed first)."""
        self._check_running()
        packet = StepPacket(self._ops, self._previous_digest, now=time.monotonic(), seed=self._seeds.getrandbits(63))
        self._ops = []
        try:
            self.tp.broadcast_bytes(msgspec.msgpack.encode(packet))
            outputs = _run_step(self.engine, packet)
        except BaseException as exc:
            self._failure = exc
            raise
        self._previous_digest = outputs_digest(outputs)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestResult]:
        """Engine.generate over the whole group: prompts to completion, results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self.engine._next_seq_id}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        while any(not s.is_finished for rid in ids for s in self.engine._requests[rid]):
            self.step()
        self.flush()  # as Engine.generate: a launched step may hold only discarded rows
        results = [self.engine._result(rid) for rid in ids]
        for rid in ids:
            self.release_finished(rid)
        return results

    def import_request(self, *args, **kwargs):
        raise NotImplementedError("PD KV imports are not supported with tensor parallelism")

    def finish_import(self, *args, **kwargs):
        raise NotImplementedError("PD KV imports are not supported with tensor parallelism")

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Stop the followers' loops and leave the group; True when spawned followers ended cleanly."""
        if self._is_stopped:
            return True
        self._is_stopped = True
        if self._failure is None:
            self.tp.broadcast_bytes(msgspec.msgpack.encode(StepPacket(self._ops, self._previous_digest, is_stop=True)))
        self._ops = []
        is_clean = self._failure is None
        if self._followers is not None:
            is_clean = self._followers.join(timeout_s if is_clean else 0.0) and is_clean
        destroy_tensor_parallel()
        return is_clean

    def _check_running(self) -> None:
        if self._failure is not None:
            raise RuntimeError("a tensor-parallel step failed earlier; the ranks are out of step") from self._failure
        if self._is_stopped:
            raise RuntimeError("the tensor-parallel engine was shut down")


def follow(engine: Engine) -> None:
    """Ranks 1..N-1: apply rank 0's ops and run the same steps until rank 0 shuts the group down."""
    tp = engine.tp
    if tp is None or tp.is_leader:
        raise ValueError("follow() runs on ranks 1..N-1 of a tensor-parallel group")
    digest, num_steps = outputs_digest([]), 0
    while True:
        packet = _PACKET_DECODER.decode(tp.broadcast_bytes())
        if packet.previous_digest != digest:
            raise TensorParallelDivergence(f"rank {tp.rank}: the outputs of step {num_steps} differ from rank 0's "
                                           f"(digest {digest:#x} vs {packet.previous_digest:#x})")
        for op in packet.ops:
            _apply(engine, op)
        if packet.is_stop:
            return
        digest = outputs_digest(_run_step(engine, packet))
        num_steps += 1
        engine.cache.drain_events()  # KV events are rank 0's to report


def run_follower(config: EngineConfig) -> None:
    """A spawned follower rank's whole life: build its shard of the engine, follow rank 0 until shutdown.

    Ctrl-C reaches the whole process group; a follower leaves that to rank 0, which stops it in order.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    follow(Engine(config))


def start_engine(config: EngineConfig) -> Engine | LockstepEngine:
    """The worker's engine: an Engine, or with tensor_parallel_size > 1, rank 0's LockstepEngine in this
    process with ranks 1..N-1 spawned as followers (call shutdown() at the end)."""
    size = config.tensor_parallel_size
    if size == 1:
        return Engine(config)
    device_type = "cuda" if config.resolved_device().startswith("cuda") else "cpu"
    followers = spawn_followers(size, run_follower, config, device_type=device_type)
    try:
        init_tensor_parallel(0, size, followers.init_method, device_type)
        engine = Engine(config)
    except BaseException:
        destroy_tensor_parallel()
        followers.join(timeout_s=0.0)
        raise
    return LockstepEngine(engine, followers)
