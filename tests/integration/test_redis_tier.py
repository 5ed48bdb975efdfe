"""The Redis tier against a real redis-server: round trips of many sizes, batch lookups in one
command, two tier instances sharing one server, TTLs, key prefixes, content addressing and
cancellation.  Each test starts its own server on a free port (``redis_server``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore import codec
from kvstore.errors import ConfigError
from kvstore.keys import ObjectKey
from tests.kits import chain as kv
from tests.kits.redis_tier import PART, open_redis_tier
from tiers.base import PutResult, Tier, put_bytes
from tiers.redis import RedisTier
from tiers.redis_config import RedisConfig

KiB = 1024
NS = kv.namespace("redis-tier")


def keys_of(n: int, seed: int = 0) -> list[ObjectKey]:
    return kv.keys_of(NS, n, seed)


def make_object(key: ObjectKey, size: int) -> np.ndarray:
    return kv.make_object(key, size)


def command_calls(server) -> dict[str, int]:
    """Calls per command, without the observer's own INFO/CLIENT/HELLO commands."""
    stats = server.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if not name.startswith(("cmdstat_info", "cmdstat_client", "cmdstat_hello"))
    }


def calls_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


SIZES = [codec.HEADER_SIZE + 1, 4 * KiB, PART - 1, PART, PART + 1, 2 * PART, 3 * PART + 5]


async def test_round_trips_of_many_sizes_are_byte_exact(redis_server):
    tier = await open_redis_tier(redis_server)
    assert isinstance(tier, Tier) and tier.name == "redis"
    keys = keys_of(len(SIZES))
    for key, size in zip(keys, SIZES):
        obj = make_object(key, size)
        assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
        assert await tier.size_of(key) == size
        out = np.zeros(size + 333, np.uint8)  # a caller buffer larger than the object
        assert await tier.read_into(key, memoryview(out)) == size
        assert np.array_equal(out[:size], obj) and not out[size:].any()
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.put_failures, s.corrupt) == (len(SIZES), 0, len(SIZES), 0, 0)
    assert s.bytes_read == s.bytes_written == sum(SIZES)
    # Exactly one manifest plus ceil(size / part) parts per object, and nothing else.
    with redis_server.client() as c:
        assert c.dbsize() == sum(1 + -(-size // PART) for size in SIZES)
    await tier.aclose()


async def test_default_part_size_object_of_three_parts_and_a_few_bytes(redis_server):
    tier = await RedisTier.open(RedisConfig.from_url(redis_server.url))
    size = 3 * tier.cfg.part_size + 3
    key = keys_of(1, 7)[0]
    obj = make_object(key, size)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    out = np.empty(size, np.uint8)
    assert await tier.read_into(key, memoryview(out)) == size
    assert np.array_equal(out, obj)
    with redis_server.client() as c:
        assert len(c.keys("kvstore:p:*")) == 4 and len(c.keys("kvstore:m:*")) == 1
    await tier.aclose()


async def test_aligned_writes_use_set_and_unaligned_writes_still_work(redis_server):
    tier = await open_redis_tier(redis_server)
    k1, k2 = keys_of(2, 3)
    size = 3 * PART + 100
    before = command_calls(redis_server)
    assert await put_bytes(tier, k1, memoryview(make_object(k1, size))) is PutResult.STORED
    delta = calls_delta(before, command_calls(redis_server))
    assert delta.get("set") == 4 + 1 and "setrange" not in delta  # 4 parts + the manifest
    obj = make_object(k2, size)
    handle = await tier.put_start(k2, size)
    assert handle is not None and handle.buffer is None
    cuts = [0, 1000, PART - 7, PART + 13, 2 * PART, 2 * PART + 1, size - 50, size]
    for lo, hi in reversed(list(zip(cuts, cuts[1:]))):  # out of order, across part boundaries
        await tier.put_write(handle, lo, memoryview(obj)[lo:hi])
    assert await tier.put_commit(handle, True)
    out = np.empty(size, np.uint8)
    assert await tier.read_into(k2, memoryview(out)) == size and np.array_equal(out, obj)
    await tier.aclose()


async def test_incomplete_put_is_not_published(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 4)[0]
    obj = make_object(key, 2 * PART)
    handle = await tier.put_start(key, len(obj))
    await tier.put_write(handle, 0, memoryview(obj)[:PART])  # the second part never written
    assert await tier.put_commit(handle, True) is False
    assert not await tier.contains(key)
    assert tier.stats().put_failures == 1
    with redis_server.client() as c:
        assert c.dbsize() == 0
    with pytest.raises(ConfigError, match="outside a"):
        h = await tier.put_start(key, len(obj))
        try:
            await tier.put_write(h, PART, memoryview(obj))  # runs past the end
        finally:
            await tier.put_commit(h, False)
    await tier.aclose()


async def test_present_and_lookup_give_the_contiguous_prefix(redis_server):
    tier = await open_redis_tier(redis_server)
    keys = keys_of(6, 5)
    for i in (0, 1, 2, 4):
        assert await put_bytes(tier, keys[i], memoryview(make_object(keys[i], 300))) is PutResult.STORED
    assert await tier.present(keys) == [True, True, True, False, True, False]
    assert await tier.lookup(keys) == 3
    assert await tier.lookup(keys[3:]) == 0
    assert await tier.lookup([]) == 0 and await tier.present([]) == []
    assert await tier.contains(keys[4]) and not await tier.contains(keys[5])
    await tier.aclose()


async def test_lookup_of_512_keys_is_one_command(redis_server):
    tier = await open_redis_tier(redis_server)
    keys = keys_of(512, 6)
    for key in keys[:500]:
        assert await put_bytes(tier, key, memoryview(make_object(key, 300))) is PutResult.STORED
    trips = tier.stats().extra["round_trips"]
    before = command_calls(redis_server)
    assert await tier.lookup(keys) == 500
    assert calls_delta(before, command_calls(redis_server)) == {"mget": 1}
    assert tier.stats().extra["round_trips"] == trips + 1
    await tier.aclose()


async def test_second_tier_instance_hits_what_the_first_stored(redis_server):
    writer, reader = await open_redis_tier(redis_server), await open_redis_tier(redis_server)
    keys = keys_of(3, 8)
    objs = [make_object(k, PART * 2 + 17) for k in keys]
    for key, obj in zip(keys, objs):
        assert await put_bytes(writer, key, memoryview(obj)) is PutResult.STORED
    assert await reader.lookup(keys) == 3
    out = np.empty(len(objs[0]), np.uint8)
    for key, obj in zip(keys, objs):
        assert await reader.read_into(key, memoryview(out)) == len(obj)
        assert np.array_equal(out, obj)
    assert await put_bytes(reader, keys[0], memoryview(objs[0])) is PutResult.EXISTS
    assert reader.stats().hits == 3 and writer.stats().hits == 0
    await writer.aclose()
    await reader.aclose()


async def test_ttl_expires_manifest_and_parts(redis_server):
    tier = await open_redis_tier(redis_server, ttl_s=0.4)
    key = keys_of(1, 9)[0]
    assert await put_bytes(tier, key, memoryview(make_object(key, 2 * PART + 1))) is PutResult.STORED
    with redis_server.client() as c:
        ttls = [c.pttl(k) for k in c.keys("*")]
        assert len(ttls) == 4 and all(0 < t <= 400 for t in ttls)
        assert await tier.contains(key)
        await asyncio.sleep(0.6)
        assert not await tier.contains(key)
        assert c.dbsize() == 0
    assert await tier.read_into(key, memoryview(np.empty(3 * PART, np.uint8))) is None
    await tier.aclose()


async def test_without_ttl_committed_keys_persist_and_abandoned_parts_expire(redis_server):
    tier = await open_redis_tier(redis_server, orphan_ttl_s=30)
    k1, k2 = keys_of(2, 10)
    assert await put_bytes(tier, k1, memoryview(make_object(k1, 2 * PART))) is PutResult.STORED
    handle = await tier.put_start(k2, 2 * PART)
    await tier.put_write(handle, 0, memoryview(make_object(k2, 2 * PART)))  # never committed
    with redis_server.client() as c:
        committed = [k for k in c.keys("*") if k1.printable().encode() in k]
        assert len(committed) == 3 and all(c.pttl(k) == -1 for k in committed)
        orphans = [k for k in c.keys("*") if k2.printable().encode() in k]
        assert len(orphans) == 2 and all(0 < c.pttl(k) <= 30_000 for k in orphans)
        assert not await tier.contains(k2)
        assert await tier.put_commit(handle, False) is False  # abandoning removes them now
        assert c.dbsize() == 3
    await tier.aclose()


async def test_key_prefix_isolates_tiers(redis_server):
    a = await open_redis_tier(redis_server, key_prefix="tenant-a:")
    b = await open_redis_tier(redis_server, key_prefix="tenant-b:")
    key = keys_of(1, 11)[0]
    obj = make_object(key, PART + 9)
    assert await put_bytes(a, key, memoryview(obj)) is PutResult.STORED
    assert await a.contains(key) and not await b.contains(key)
    assert await b.read_into(key, memoryview(np.empty(len(obj), np.uint8))) is None
    assert await put_bytes(b, key, memoryview(obj)) is PutResult.STORED
    with redis_server.client() as c:
        names = sorted(k.decode() for k in c.keys("*"))
    assert len(names) == 6
    assert all(n.startswith(("tenant-a:m:", "tenant-a:p:", "tenant-b:m:", "tenant-b:p:")) for n in names)
    assert await a.delete(key) and not await a.contains(key) and await b.contains(key)
    await a.aclose()
    await b.aclose()


async def test_delete_removes_every_key(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 12)[0]
    assert await put_bytes(tier, key, memoryview(make_object(key, 3 * PART))) is PutResult.STORED
    assert await tier.delete(key) is True
    assert await tier.delete(key) is False
    assert await tier.size_of(key) is None
    with redis_server.client() as c:
        assert c.dbsize() == 0
    await tier.aclose()


async def test_concurrent_puts_of_one_key_leave_one_object(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 13)[0]
    obj = make_object(key, 4 * PART)
    results = await asyncio.gather(*(put_bytes(tier, key, memoryview(obj)) for _ in range(4)))
    assert set(results) <= {PutResult.STORED, PutResult.EXISTS} and PutResult.STORED in results
    with redis_server.client() as c:
        assert c.dbsize() == 1 + 4  # the losers' parts were removed
    out = np.empty(len(obj), np.uint8)
    assert await tier.read_into(key, memoryview(out)) == len(obj) and np.array_equal(out, obj)
    await tier.aclose()


async def test_buffer_too_small_is_a_config_error(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 14)[0]
    assert await put_bytes(tier, key, memoryview(make_object(key, PART))) is PutResult.STORED
    with pytest.raises(ConfigError, match="cannot hold"):
        await tier.read_into(key, memoryview(np.empty(PART - 1, np.uint8)))
    await tier.aclose()


async def test_cancelled_read_leaves_the_buffer_alone_once_it_returns(redis_server):
    tier = await open_redis_tier(redis_server, part_size="16KiB", max_inflight_parts=2)
    key = keys_of(1, 15)[0]
    size = 8 << 20  # 512 parts: the read takes long enough to be cancelled mid-way
    assert await put_bytes(tier, key, memoryview(make_object(key, size))) is PutResult.STORED
    out = np.zeros(size, np.uint8)
    cancelled = 0
    for delay in (0.0, 0.001, 0.005, 0.02):
        out[:] = 0
        task = asyncio.create_task(tier.read_into(key, memoryview(out)))
        await asyncio.sleep(delay)
        if not task.cancel():
            continue  # already finished: nothing to cancel
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled += 1
        snapshot = out.copy()
        await asyncio.sleep(0.05)  # any part task still alive would write during this
        assert np.array_equal(out, snapshot)
    assert cancelled >= 3
    assert await tier.read_into(key, memoryview(out)) == size  # the tier still works
    assert tier.stats().hits == 1 + 4 - cancelled
    await tier.aclose()
