"""Objects of one part in the Redis tier (``tiers.redis_manifest``: inline), against a real
redis-server: a read is ONE round trip (manifest and value pipelined), the layout is two
keys, and every safety property of the parts layout holds: a value without its manifest is
invisible, a dead writer's value expires, concurrent writers leave one object, a value lost
or damaged is a counted miss and is cleaned up, and a stray value never disturbs an object
of parts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore import codec
from kvstore.errors import ConfigError
from kvstore.keys import ObjectKey
from tests.kits import chain as kv
from tests.kits.redis_tier import PART, open_redis_tier
from tiers.base import PutResult, put_bytes
from tiers.redis import RedisTier
from tiers.redis_manifest import INLINE, MANIFEST_SIZE, inline_key, manifest_key, unpack

KiB = 1024
NS = kv.namespace("redis-inline")


def keys_of(n: int, seed: int = 0) -> list[ObjectKey]:
    return kv.keys_of(NS, n, seed)


def names(key: ObjectKey) -> tuple[str, str]:
    return manifest_key("kvstore:", key), inline_key("kvstore:", key)


def calls(server) -> dict[str, int]:
    stats = server.info("commandstats")
    return {
        n.removeprefix("cmdstat_"): int(v["calls"])
        for n, v in stats.items()
        if not n.startswith(("cmdstat_info", "cmdstat_client", "cmdstat_hello"))
    }


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


async def read_back(tier: RedisTier, key: ObjectKey, size: int) -> np.ndarray | None:
    out = np.zeros(size, np.uint8)
    n = await tier.read_into(key, memoryview(out))
    return None if n is None else out[:n]


@pytest.mark.parametrize("size", [codec.HEADER_SIZE + 1, 4 * KiB, PART])
async def test_a_small_object_is_two_keys_and_one_round_trip(redis_server, size):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, size % 1000)[0]
    obj = kv.make_object(key, size)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    mkey, ikey = names(key)
    with redis_server.client() as c:
        assert sorted(c.keys("*")) == sorted([mkey.encode(), ikey.encode()])
        raw = c.get(mkey)
        assert len(raw) == MANIFEST_SIZE and raw[6] & INLINE and unpack(raw).inline
        assert c.get(ikey) == obj.tobytes()  # exactly the object's bytes
        assert c.pttl(ikey) == -1 and c.pttl(mkey) == -1  # no ttl_s: both persist
    trips, before = tier.stats().extra["round_trips"], calls(redis_server)
    out = np.full(size + 64, 0xA5, np.uint8)
    assert await tier.read_into(key, memoryview(out)) == size
    assert np.array_equal(out[:size], obj) and (out[size:] == 0xA5).all()
    assert tier.stats().extra["round_trips"] - trips == 1  # one pipeline
    assert delta(before, calls(redis_server)) == {"get": 2}  # the manifest and the value
    s = tier.stats()
    assert (s.hits, s.extra["bulk_reads"], s.extra["bulk_fallbacks"]) == (1, 1, 0)
    await tier.aclose()


async def test_pieces_written_out_of_order_are_sent_once_whole(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 1)[0]
    obj = kv.make_object(key, PART - 100)
    before = calls(redis_server)
    handle = await tier.put_start(key, len(obj))
    cuts = [0, 7, 5000, 5001, len(obj) - 3, len(obj)]
    for lo, hi in reversed(list(zip(cuts, cuts[1:]))):
        await tier.put_write(handle, lo, memoryview(obj.copy())[lo:hi])  # the caller reuses its buffer
    assert await tier.put_commit(handle, True)
    d = delta(before, calls(redis_server))
    assert d.get("set") == 2 and "setrange" not in d  # the value, then the manifest
    got = await read_back(tier, key, len(obj))
    assert got is not None and np.array_equal(got, obj)
    await tier.aclose()


async def test_a_value_without_its_manifest_is_invisible_and_dies_with_its_writer(redis_server):
    tier = await open_redis_tier(redis_server, orphan_ttl_s=30)
    k1, k2 = keys_of(2, 2)
    obj = kv.make_object(k1, 2 * KiB)
    handle = await tier.put_start(k1, len(obj))
    await tier.put_write(handle, 0, memoryview(obj))  # the writer "dies" here
    mkey, ikey = names(k1)
    with redis_server.client() as c:
        assert c.exists(ikey) and not c.exists(mkey)
        assert 0 < c.pttl(ikey) <= 30_000  # it expires by itself
    assert not await tier.contains(k1)
    assert await read_back(tier, k1, len(obj)) is None  # complete, but not published
    assert await tier.put_commit(handle, False) is False  # abandoned: removed now
    with redis_server.client() as c:
        assert c.dbsize() == 0
    s = tier.stats()
    assert (s.corrupt, s.extra["lost"]) == (0, 0)
    await tier.aclose()


async def test_a_dead_writers_value_is_adopted_by_the_next_put(redis_server):
    tier = await open_redis_tier(redis_server, orphan_ttl_s=30)
    key = keys_of(1, 3)[0]
    obj = kv.make_object(key, 3 * KiB)
    mkey, ikey = names(key)
    with redis_server.client() as c:
        c.set(ikey, obj.tobytes(), px=30_000)  # left by a killed writer
        assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
        assert c.pttl(ikey) == -1 and c.pttl(mkey) == -1  # adopted: the final TTL
    got = await read_back(tier, key, len(obj))
    assert got is not None and np.array_equal(got, obj)
    await tier.aclose()


async def test_concurrent_puts_of_one_small_key_leave_one_object(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 4)[0]
    obj = kv.make_object(key, PART)
    results = await asyncio.gather(*(put_bytes(tier, key, memoryview(obj)) for _ in range(6)))
    assert set(results) <= {PutResult.STORED, PutResult.EXISTS} and PutResult.STORED in results
    with redis_server.client() as c:
        assert c.dbsize() == 2 and all(c.pttl(k) == -1 for k in c.keys("*"))
    got = await read_back(tier, key, PART)
    assert got is not None and np.array_equal(got, obj)
    await tier.aclose()


async def test_a_lost_value_is_counted_cleaned_and_repaired_by_a_later_put(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 5)[0]
    obj = kv.make_object(key, 8 * KiB)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    mkey, ikey = names(key)
    with redis_server.client() as c:
        c.delete(ikey)  # evicted, say
        assert await read_back(tier, key, len(obj)) is None
        assert c.dbsize() == 0  # its manifest went too
        s = tier.stats()
        assert (s.misses, s.corrupt, s.extra["lost"]) == (1, 0, 1)
        assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
        c.delete(ikey)  # lost again, then a put meets
        handle = await tier.put_start(key, len(obj))  # the dangling manifest
        await tier.put_write(handle, 0, memoryview(obj))
        assert await tier.put_commit(handle, True) is True  # "exists": a success
        assert c.pttl(ikey) == -1  # and its value serves it
    got = await read_back(tier, key, len(obj))
    assert got is not None and np.array_equal(got, obj)
    await tier.aclose()


@pytest.mark.parametrize("damage", ["flip", "shorter", "longer", "other key"])
async def test_a_damaged_value_is_a_counted_miss_and_deleted(redis_server, damage):
    tier = await open_redis_tier(redis_server)
    key, other = keys_of(2, 6)
    size = 16 * KiB
    obj = kv.make_object(key, size)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    _, ikey = names(key)
    bad = {
        "flip": lambda b: b[:9000] + bytes([b[9000] ^ 1]) + b[9001:],
        "shorter": lambda b: b[:-1],
        "longer": lambda b: b + b"x",
        "other key": lambda b: kv.make_object(other, size).tobytes(),
    }[damage]
    with redis_server.client() as c:
        c.set(ikey, bad(obj.tobytes()))
        assert await read_back(tier, key, size + 1) is None
        assert c.dbsize() == 0
    s = tier.stats()
    assert (s.misses, s.corrupt, s.extra["lost"], s.extra["breaker_opened"]) == (1, 1, 0, 0)
    await tier.aclose()


async def test_a_stray_value_never_disturbs_an_object_of_parts(redis_server):
    tier = await open_redis_tier(redis_server)
    k1, k2 = keys_of(2, 7)
    for key, stray in ((k1, 5), (k2, 10 * PART)):  # smaller; larger than the buffer
        obj = kv.make_object(key, 3 * PART + 1)
        assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
        with redis_server.client() as c:
            c.set(names(key)[1], b"\xee" * stray)
        got = await read_back(tier, key, len(obj))
        assert got is not None and np.array_equal(got, obj)
    s = tier.stats()
    assert (s.hits, s.corrupt, s.extra["lost"]) == (2, 0, 0)
    await tier.aclose()


async def test_an_error_reply_for_the_value_falls_back_and_is_a_plain_miss(redis_server):
    tier = await open_redis_tier(redis_server)
    key = keys_of(1, 8)[0]
    assert await put_bytes(tier, key, memoryview(kv.make_object(key, 4 * KiB))) is PutResult.STORED
    with redis_server.client() as c:
        ikey = names(key)[1]
        c.delete(ikey)
        c.rpush(ikey, b"not a string")  # GET answers -WRONGTYPE
    assert await read_back(tier, key, 4 * KiB) is None
    s = tier.stats()
    assert (s.misses, s.corrupt, s.extra["lost"], s.extra["bulk_fallbacks"]) == (1, 0, 0, 1)
    assert await tier.contains(key)  # not proof the object is dead
    await tier.aclose()


async def test_ttl_and_buffer_checks_apply_to_small_objects(redis_server):
    tier = await open_redis_tier(redis_server, ttl_s=0.4)
    key = keys_of(1, 9)[0]
    obj = kv.make_object(key, PART)
    assert await put_bytes(tier, key, memoryview(obj)) is PutResult.STORED
    with pytest.raises(ConfigError, match="cannot hold"):
        await tier.read_into(key, memoryview(np.empty(PART - 1, np.uint8)))
    with redis_server.client() as c:
        assert all(0 < c.pttl(k) <= 400 for k in c.keys("*")) and c.dbsize() == 2
        await asyncio.sleep(0.6)
        assert c.dbsize() == 0
    await tier.aclose()
