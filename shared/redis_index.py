"""The global prefix index in Redis: its key layout, the writer ops (cache_index) and the one-round-trip
longest-prefix reader (scheduler).

    rs:blk:{block_hash}       set of worker ids whose radix cache holds that block
    rs:wrk:{worker_id}        set of block hashes that worker holds (reverse index: O(own blocks) cleanup)
    rs:wrk:{worker_id}:meta   hash {incarnation, next_seq}: the event number the index is exact up to
    rs:epoch                  a random token set once per Redis lifetime: when it vanishes or changes, the
                              database was emptied (a restart without persistence) and writers rebuild

NOTE: one writer per worker id (the cache_index that receives its events), so a read-then-write of one
worker's keys (clear_worker, replace_worker) is not raced by another writer of the same worker.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis

from shared.messages import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

BLOCK_PREFIX = "rs:blk:"
WORKER_PREFIX = "rs:wrk:"
EPOCH_KEY = "rs:epoch"

# KEYS = the block keys of one prompt in chain order. Returns a flat list [worker, num_blocks, ...]: each
# worker that holds KEYS[1], with the number of leading blocks it holds without a break.
LONGEST_PREFIX_LUA = """
local alive = {}
local num_alive = 0
for _, worker in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  alive[worker] = true
  num_alive = num_alive + 1
end
local result = {}
local depth = 1
while num_alive > 0 and depth < #KEYS do
  depth = depth + 1
  for worker in pairs(alive) do
    if redis.call('SISMEMBER', KEYS[depth], worker) == 0 then
      alive[worker] = nil
      num_alive = num_alive - 1
      table.insert(result, worker)
      table.insert(result, depth - 1)
    end
  end
end
for worker in pairs(alive) do
  table.insert(result, worker)
  table.insert(result, depth)
end
return result
"""


def block_key(block_hash: int) -> str:
    return f"{BLOCK_PREFIX}{block_hash}"


def worker_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}"


def meta_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}:meta"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _queue_add(pipe: Any, worker_id: str, block_hashes: Sequence[int]) -> None:
    for block_hash in block_hashes:
        pipe.sadd(block_key(block_hash), worker_id)
    if block_hashes:
        pipe.sadd(worker_key(worker_id), *block_hashes)


def _queue_remove(pipe: Any, worker_id: str, block_hashes: Iterable[int]) -> None:
    block_hashes = list(block_hashes)
    for block_hash in block_hashes:
        pipe.srem(block_key(block_hash), worker_id)
    if block_hashes:
        pipe.srem(worker_key(worker_id), *block_hashes)


def _queue_meta(pipe: Any, worker_id: str, incarnation: str, next_seq: int) -> None:
    pipe.hset(meta_key(worker_id), mapping={"incarnation": incarnation, "next_seq": next_seq})


async def index_epoch(r: aioredis.Redis) -> str:
    """The index's epoch token, created if missing (SET NX then GET, one round trip): a writer that sees it
    differ from the one it saw before knows Redis lost the index."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
        pipe.get(EPOCH_KEY)
        _, epoch = await pipe.execute()
    return _text(epoch)


async def add_blocks(r: aioredis.Redis, worker_id: str, block_hashes: Sequence[int]) -> None:
    """Record that worker_id holds these blocks (one atomic round trip)."""
    async with r.pipeline(transaction=True) as pipe:
        _queue_add(pipe, worker_id, block_hashes)
        await pipe.execute()


async def remove_blocks(r: aioredis.Redis, worker_id: str, block_hashes: Sequence[int]) -> None:
    """Record that worker_id no longer holds these blocks (an emptied block set vanishes with its key)."""
    async with r.pipeline(transaction=True) as pipe:
        _queue_remove(pipe, worker_id, block_hashes)
        await pipe.execute()


async def worker_blocks(r: aioredis.Redis, worker_id: str) -> set[int]:
    """Every block hash the index says worker_id holds (the reverse index)."""
    return {int(h) for h in await r.smembers(worker_key(worker_id))}


async def worker_meta(r: aioredis.Redis, worker_id: str) -> tuple[str, int] | None:
    """(incarnation, next_seq) the index of worker_id is exact up to, or None if it has none."""
    meta = {_text(k): _text(v) for k, v in (await r.hgetall(meta_key(worker_id))).items()}
    if "incarnation" not in meta or "next_seq" not in meta:
        return None
    return meta["incarnation"], int(meta["next_seq"])


async def clear_worker(r: aioredis.Redis, worker_id: str) -> int:
    """Forget worker_id entirely (blocks, reverse index, meta); returns how many blocks it held.

    One read of the reverse index, then one pipelined transaction of the removals.
    """
    held = await worker_blocks(r, worker_id)
    async with r.pipeline(transaction=True) as pipe:
        _queue_remove(pipe, worker_id, held)
        pipe.delete(worker_key(worker_id), meta_key(worker_id))
        await pipe.execute()
    return len(held)


async def replace_worker(r: aioredis.Redis, worker_id: str, block_hashes: Sequence[int], incarnation: str,
                         next_seq: int) -> None:
    """Make the index of worker_id exactly block_hashes as of (incarnation, next_seq): a snapshot.

    Only the difference from what the index holds is written, in one transaction, so a reader never sees
    the worker's unchanged blocks disappear.
    """
    held = await worker_blocks(r, worker_id)
    wanted = set(block_hashes)
    async with r.pipeline(transaction=True) as pipe:
        _queue_remove(pipe, worker_id, held - wanted)
        _queue_add(pipe, worker_id, sorted(wanted - held))
        _queue_meta(pipe, worker_id, incarnation, next_seq)
        await pipe.execute()


async def apply_events(r: aioredis.Redis, worker_id: str, events: Sequence[KVEvent], incarnation: str,
                       next_seq: int) -> None:
    """Apply one worker's events in order and set its meta to (incarnation, next_seq).

    One transaction per run of BlocksStored/BlocksRemoved; an AllBlocksCleared flushes what is queued and
    clears through the reverse index.
    """
    pipe = r.pipeline(transaction=True)
    try:
        for event in events:
            if isinstance(event, BlocksStored):
                _queue_add(pipe, worker_id, event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                _queue_remove(pipe, worker_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                await pipe.execute()
                await clear_worker(r, worker_id)
        _queue_meta(pipe, worker_id, incarnation, next_seq)
        await pipe.execute()
    finally:
        await pipe.reset()


async def longest_prefix(r: aioredis.Redis, block_hashes: Sequence[int]) -> dict[str, int]:
    """{worker_id: number of leading blocks of this chain it holds} for every worker holding the first
    block, in one round trip (a server-side script; EVALSHA, falling back to EVAL once per server)."""
    if not block_hashes:
        return {}
    script = r.register_script(LONGEST_PREFIX_LUA)
    flat = await script(keys=[block_key(h) for h in block_hashes])
    return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
