"""The global prefix index in Redis: its key layout, the writer ops (cache_index) and the one-round-trip
longest-prefix reader (scheduler).

    rs:blk:{block_hash}       set of "worker_id@gen": the worker generations whose radix cache holds that block
    rs:live                   hash worker_id → its live generation; an entry of any other generation is dead
    rs:gen                    counter: generations are numbered once per Redis lifetime, never reused
    rs:rev:{gen}:{bucket}     the block hashes one generation holds in one bucket (reverse index, NUM_BUCKETS)
    rs:dig:{gen}              hash bucket → sum of its blocks' weights (a digest), "n" → number of blocks
    rs:dead                   hash gen → "worker_id@gen": dead generations whose entries await collection
    rs:wrk:{worker_id}:meta   hash {incarnation, next_seq}: the event number the index is exact up to
    rs:epoch                  a random token set once per Redis lifetime: when it vanishes or changes, the
                              database was emptied (a restart without persistence) and writers rebuild

Forgetting a worker is O(1): its generation leaves rs:live and readers stop seeing its entries at once;
collect_garbage then removes them in bounded batches. A snapshot compares per-bucket digests first and reads
only the buckets that differ, so an unchanged snapshot costs one small read, not one per block.

NOTE: one writer per worker id (the cache_index that receives its events), so a read-then-write of one
worker's keys (replace_worker) is not raced by another writer of the same worker. The scripts name keys they
derive from a generation, so the index needs one Redis, not a cluster.
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from shared.messages import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

BLOCK_PREFIX = "rs:blk:"
WORKER_PREFIX = "rs:wrk:"
REVERSE_PREFIX = "rs:rev:"
DIGEST_PREFIX = "rs:dig:"
LIVE_KEY = "rs:live"
GEN_KEY = "rs:gen"
DEAD_KEY = "rs:dead"
EPOCH_KEY = "rs:epoch"
COUNT_FIELD = "n"

BUCKET_BITS = 10
NUM_BUCKETS = 1 << BUCKET_BITS  # 500k blocks: ~490 per bucket, the most a changed bucket costs to read
MAX_BATCH_BLOCKS = 1000  # blocks one script call touches: ~1 ms of Redis, so readers wait at most that
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads even small test hashes over the buckets
_WEIGHT_MASK = np.uint64((1 << 40) - 1)  # weights 1..2^40: a bucket's sum fits HINCRBY's int64 below 2^23 blocks

_KEYS = {"@BLK@": BLOCK_PREFIX, "@REV@": REVERSE_PREFIX, "@DIG@": DIGEST_PREFIX, "@N@": COUNT_FIELD}


def _lua(source: str) -> str:
    for placeholder, value in _KEYS.items():
        source = source.replace(placeholder, value)
    return source


# KEYS = rs:live, then the block keys of one prompt in chain order. Returns a flat list [worker, num_blocks, ...]:
# each worker whose live generation holds the first block, with the number of leading blocks it holds unbroken.
LONGEST_PREFIX_LUA = """
local alive = {}
local num_alive = 0
for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local worker, gen = string.match(member, '^(.*)@(%d+)$')
  if worker and redis.call('HGET', KEYS[1], worker) == gen then
    alive[member] = worker
    num_alive = num_alive + 1
  end
end
local result = {}
local depth = 1
while num_alive > 0 and depth < #KEYS - 1 do
  depth = depth + 1
  for member, worker in pairs(alive) do
    if redis.call('SISMEMBER', KEYS[depth + 1], member) == 0 then
      alive[member] = nil
      num_alive = num_alive - 1
      table.insert(result, worker)
      table.insert(result, depth - 1)
    end
  end
end
for _, worker in pairs(alive) do
  table.insert(result, worker)
  table.insert(result, depth)
end
return result
"""

# KEYS = rs:live, rs:gen. ARGV = worker_id, '1' (add) or '-1' (remove), then (hash, bucket, weight) triples.
# Adds to the worker's live generation (a new one if it has none); only blocks whose reverse-index membership
# changed touch the block sets and the digest. Returns the change in the number of blocks held.
WRITE_LUA = _lua("""
local gen = redis.call('HGET', KEYS[1], ARGV[1])
local is_add = ARGV[2] == '1'
if not gen then
  if not is_add then return 0 end
  gen = tostring(redis.call('INCR', KEYS[2]))
  redis.call('HSET', KEYS[1], ARGV[1], gen)
end
local member = ARGV[1] .. '@' .. gen
local digest = '@DIG@' .. gen
local changed = 0
for i = 3, #ARGV, 3 do
  local reverse = '@REV@' .. gen .. ':' .. ARGV[i + 1]
  if is_add then
    if redis.call('SADD', reverse, ARGV[i]) == 1 then
      redis.call('SADD', '@BLK@' .. ARGV[i], member)
      redis.call('HINCRBY', digest, ARGV[i + 1], ARGV[i + 2])
      changed = changed + 1
    end
  elseif redis.call('SREM', reverse, ARGV[i]) == 1 then
    redis.call('SREM', '@BLK@' .. ARGV[i], member)
    if redis.call('HINCRBY', digest, ARGV[i + 1], '-' .. ARGV[i + 2]) == 0 then
      redis.call('HDEL', digest, ARGV[i + 1])
    end
    changed = changed - 1
  end
end
if changed ~= 0 and redis.call('HINCRBY', digest, '@N@', changed) == 0 then
  redis.call('HDEL', digest, '@N@')
end
return changed
""")

# KEYS = rs:live, rs:dead, the worker's meta key. ARGV = worker_id. Retires its live generation (O(1)) and
# returns how many blocks that generation held.
CLEAR_LUA = _lua("""
redis.call('DEL', KEYS[3])
local gen = redis.call('HGET', KEYS[1], ARGV[1])
if not gen then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], gen, ARGV[1] .. '@' .. gen)
return tonumber(redis.call('HGET', '@DIG@' .. gen, '@N@') or '0')
""")

# KEYS = rs:dead. ARGV = gen, its member, max_blocks. Removes up to max_blocks of that dead generation's entries;
# once none is left, its digest and its rs:dead entry go too. Returns how many entries it removed.
COLLECT_LUA = _lua("""
local gen, member, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local digest = '@DIG@' .. gen
local removed = 0
for _, bucket in ipairs(redis.call('HKEYS', digest)) do
  if bucket ~= '@N@' then
    local reverse = '@REV@' .. gen .. ':' .. bucket
    local hashes = redis.call('SPOP', reverse, budget - removed)
    for _, h in ipairs(hashes) do
      redis.call('SREM', '@BLK@' .. h, member)
    end
    removed = removed + #hashes
    if redis.call('EXISTS', reverse) == 0 then redis.call('HDEL', digest, bucket) end
    if removed >= budget then return removed end
  end
end
redis.call('DEL', digest)
redis.call('HDEL', KEYS[1], gen)
return removed
""")


def block_key(block_hash: int) -> str:
    return f"{BLOCK_PREFIX}{block_hash}"


def meta_key(worker_id: str) -> str:
    return f"{WORKER_PREFIX}{worker_id}:meta"


def reverse_key(gen: int, bucket: int) -> str:
    return f"{REVERSE_PREFIX}{gen}:{bucket}"


def digest_key(gen: int) -> str:
    return f"{DIGEST_PREFIX}{gen}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class BlockSet:
    """A set of block hashes grouped by bucket, with each bucket's digest (what rs:dig holds for it)."""

    hashes: np.ndarray   # [n] uint64, unique, sorted by (bucket, hash)
    buckets: np.ndarray  # [n] uint64
    weights: np.ndarray  # [n] uint64, each in 1..2^40
    sums: np.ndarray     # [NUM_BUCKETS] uint64: the sum of the weights in each bucket

    @staticmethod
    def of(block_hashes: Sequence[int]) -> BlockSet:
        hashes = np.unique(np.asarray(block_hashes, dtype=np.uint64))
        mixed = hashes * _MIX  # wraps modulo 2^64
        buckets = mixed >> np.uint64(64 - BUCKET_BITS)
        weights = ((mixed >> np.uint64(12)) & _WEIGHT_MASK) + np.uint64(1)
        order = np.argsort(buckets, kind="stable")
        sums = np.zeros(NUM_BUCKETS, dtype=np.uint64)
        np.add.at(sums, buckets, weights)
        return BlockSet(hashes[order], buckets[order], weights[order], sums)

    def in_buckets(self, buckets: np.ndarray) -> BlockSet:
        """The subset in these buckets (digests of the other buckets zeroed)."""
        mask = np.isin(self.buckets, buckets.astype(np.uint64))
        sums = np.zeros(NUM_BUCKETS, dtype=np.uint64)
        sums[buckets] = self.sums[buckets]
        return BlockSet(self.hashes[mask], self.buckets[mask], self.weights[mask], sums)

    def write_args(self, start: int, stop: int) -> list[int]:
        """The (hash, bucket, weight) triples of items [start, stop), flat, for WRITE_LUA."""
        triples = np.stack([self.hashes[start:stop], self.buckets[start:stop], self.weights[start:stop]], axis=1)
        return triples.reshape(-1).tolist()


async def index_epoch(r: aioredis.Redis) -> str:
    """The index's epoch token, created if missing (SET NX then GET, one round trip): a writer that sees it
    differ from the one it saw before knows Redis lost the index."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
        pipe.get(EPOCH_KEY)
        _, epoch = await pipe.execute()
    return _text(epoch)


async def _write_batches(client: Any, worker_id: str, blocks: BlockSet, is_add: bool) -> list[Any]:
    """WRITE_LUA over blocks in batches of at most MAX_BATCH_BLOCKS: run one after another on a client (their
    results: the change in blocks held), or queued on a pipeline."""
    script = client.register_script(WRITE_LUA)
    sign = "1" if is_add else "-1"
    return [await script(keys=[LIVE_KEY, GEN_KEY], args=[worker_id, sign, *blocks.write_args(start, start + MAX_BATCH_BLOCKS)],
                         client=client)
            for start in range(0, len(blocks.hashes), MAX_BATCH_BLOCKS)]


async def _write(r: aioredis.Redis, worker_id: str, blocks: BlockSet, is_add: bool) -> int:
    """Add or remove blocks, one bounded script call after another; returns the change in blocks held."""
    return sum(await _write_batches(r, worker_id, blocks, is_add))


async def add_blocks(r: aioredis.Redis, worker_id: str, block_hashes: Sequence[int]) -> None:
    """Record that worker_id holds these blocks (its live generation; a new one if it has none)."""
    await _write(r, worker_id, BlockSet.of(block_hashes), is_add=True)


async def remove_blocks(r: aioredis.Redis, worker_id: str, block_hashes: Sequence[int]) -> None:
    """Record that worker_id no longer holds these blocks (an emptied block set vanishes with its key)."""
    await _write(r, worker_id, BlockSet.of(block_hashes), is_add=False)


async def live_generation(r: aioredis.Redis, worker_id: str) -> int | None:
    gen = await r.hget(LIVE_KEY, worker_id)
    return None if gen is None else int(gen)


async def _bucket_hashes(r: aioredis.Redis, gen: int, buckets: Sequence[int]) -> np.ndarray:
    """[n] uint64: the block hashes generation gen holds in these buckets (pipelined SMEMBERS, 64 buckets a trip)."""
    found: list[int] = []
    for start in range(0, len(buckets), 64):
        async with r.pipeline(transaction=False) as pipe:
            for bucket in buckets[start:start + 64]:
                pipe.smembers(reverse_key(gen, int(bucket)))
            for members in await pipe.execute():
                found.extend(int(h) for h in members)
    return np.asarray(found, dtype=np.uint64)


async def _digest(r: aioredis.Redis, gen: int | None) -> np.ndarray:
    """[NUM_BUCKETS] uint64: the per-bucket digests of generation gen (zeros for none)."""
    sums = np.zeros(NUM_BUCKETS, dtype=np.uint64)
    if gen is not None:
        for field, value in (await r.hgetall(digest_key(gen))).items():
            if _text(field) != COUNT_FIELD:
                sums[int(field)] = int(value)
    return sums


async def worker_blocks(r: aioredis.Redis, worker_id: str) -> set[int]:
    """Every block hash the index says worker_id holds (its live generation's reverse index)."""
    gen = await live_generation(r, worker_id)
    if gen is None:
        return set()
    buckets = np.nonzero(await _digest(r, gen))[0]
    return {int(h) for h in (await _bucket_hashes(r, gen, buckets.tolist())).tolist()}


async def worker_meta(r: aioredis.Redis, worker_id: str) -> tuple[str, int] | None:
    """(incarnation, next_seq) the index of worker_id is exact up to, or None if it has none."""
    meta = {_text(k): _text(v) for k, v in (await r.hgetall(meta_key(worker_id))).items()}
    if "incarnation" not in meta or "next_seq" not in meta:
        return None
    return meta["incarnation"], int(meta["next_seq"])


async def clear_worker(r: aioredis.Redis, worker_id: str) -> int:
    """Forget worker_id entirely in O(1): retire its live generation (readers ignore it from now on) and drop its
    meta; returns how many blocks it held. Its entries stay until collect_garbage removes them."""
    script = r.register_script(CLEAR_LUA)
    return int(await script(keys=[LIVE_KEY, DEAD_KEY, meta_key(worker_id)], args=[worker_id]))


async def collect_garbage(r: aioredis.Redis, max_blocks: int = MAX_BATCH_BLOCKS) -> int | None:
    """Remove up to max_blocks entries of one dead generation (the oldest); returns how many were removed, None
    once no dead generation is left. Safe to run from several processes at once."""
    dead = await r.hgetall(DEAD_KEY)
    if not dead:
        return None
    gen, member = min((int(g), _text(m)) for g, m in dead.items())
    script = r.register_script(COLLECT_LUA)
    return int(await script(keys=[DEAD_KEY], args=[gen, member, max_blocks]))


async def replace_worker(r: aioredis.Redis, worker_id: str, block_hashes: Sequence[int], incarnation: str,
                         next_seq: int) -> int:
    """Make the index of worker_id exactly block_hashes as of (incarnation, next_seq): a snapshot. Returns how
    many blocks were added or removed.

    Only buckets whose digest differs are read, and only their difference is written (bounded batches), so an
    unchanged snapshot costs one read of NUM_BUCKETS digests, and a reader never sees unchanged blocks disappear.
    """
    wanted = BlockSet.of(block_hashes)
    gen = await live_generation(r, worker_id)
    changed = np.nonzero(wanted.sums != await _digest(r, gen))[0]
    num_written = 0
    if len(changed):
        wanted = wanted.in_buckets(changed)
        held = np.zeros(0, dtype=np.uint64) if gen is None else await _bucket_hashes(r, gen, changed.tolist())
        gone = BlockSet.of(np.setdiff1d(held, wanted.hashes))
        new = BlockSet.of(np.setdiff1d(wanted.hashes, held))
        num_written = -await _write(r, worker_id, gone, is_add=False) + await _write(r, worker_id, new, is_add=True)
    await r.hset(meta_key(worker_id), mapping={"incarnation": incarnation, "next_seq": next_seq})
    return num_written


async def apply_events(r: aioredis.Redis, worker_id: str, events: Sequence[KVEvent], incarnation: str,
                       next_seq: int) -> None:
    """Apply one worker's events in order and set its meta to (incarnation, next_seq).

    One transaction per run of BlocksStored/BlocksRemoved; an AllBlocksCleared flushes what is queued and
    retires the worker's generation (the next stored block starts a new one).
    """
    pipe = r.pipeline(transaction=True)
    try:
        for event in events:
            if isinstance(event, (BlocksStored, BlocksRemoved)):
                blocks = BlockSet.of(event.block_hashes)
                await _write_batches(pipe, worker_id, blocks, is_add=isinstance(event, BlocksStored))
            elif isinstance(event, AllBlocksCleared):
                await pipe.execute()
                await clear_worker(r, worker_id)
        pipe.hset(meta_key(worker_id), mapping={"incarnation": incarnation, "next_seq": next_seq})
        await pipe.execute()
    finally:
        await pipe.reset()


async def longest_prefix(r: aioredis.Redis, block_hashes: Sequence[int]) -> dict[str, int]:
    """{worker_id: number of leading blocks of this chain it holds} for every worker whose live generation holds
    the first block, in one round trip (a server-side script; EVALSHA, falling back to EVAL once per server)."""
    if not block_hashes:
        return {}
    script = r.register_script(LONGEST_PREFIX_LUA)
    flat = await script(keys=[LIVE_KEY, *(block_key(h) for h in block_hashes)])
    return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
